"""Test doubles and helpers of the operator tests, imported through pytest's pythonpath
(`from support.fake_apiserver import FakeApiServer`): the loopback API server, in-memory Kube
and probe fakes, worker status servers, the CRD's checks offline, the Helm chart rendered."""
