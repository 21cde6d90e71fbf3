"""`dsv4 up` with an hf:// `spec.model.source`: the model's config.json first (the plan is made
before any weight moves), then every file into the local Hugging Face cache with a progress bar
(`dsv4_fetch`), then the checkpoint's tensors against the plan's list. `--offline` takes only a
verified snapshot already in the cache. The token is HF_TOKEN, else the one `hf auth login`
saved (a CR's `hub.tokenSecretRef` is a cluster's Secret); the endpoint is the CR's
`hub.endpoint`, else HF_ENDPOINT, else the hub. Every failure is a `WeightsError` whose message
names `spec.model.source`.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from dsv4_common.api.deployment import SOURCE_FIELD, MemoryPlanError, model_from_config_text
from dsv4_common.api.model_files import ModelFiles
from dsv4_common.api.spec import DeploymentSpec
from dsv4_common.core.model import ModelConfig
from dsv4_common.plan.checkpoint_match import first_mismatch, published_names
from dsv4_fetch.errors import FetchError
from dsv4_fetch.fetch import FetchOptions, cached
from dsv4_fetch.hub import CONFIG_FILE, Snapshot, read_text, resolve
from dsv4_fetch.layout import RepoCache
from dsv4_fetch.run import default_cache_dir, fetch_with_progress
from dsv4_fetch.tensor_index import read_index


class WeightsError(Exception):
    """The model's files could not be had; the message names the field."""


@dataclass
class LocalWeights:
    offline: bool = False
    out: TextIO = field(default_factory=lambda: sys.stderr)
    cache_dir: Path | None = None  # None: HF_HUB_CACHE, else ~/.cache/huggingface/hub
    _resolved: dict[str, Snapshot] = field(default_factory=dict)

    def options(self, spec: DeploymentSpec) -> FetchOptions:
        from huggingface_hub import get_token

        return FetchOptions(
            cache_dir=self.cache_dir or default_cache_dir(),
            endpoint=spec.model.hub.endpoint,
            token=None if self.offline else get_token(),
            offline=self.offline,
        )

    def model_for(self, spec: DeploymentSpec) -> ModelConfig | None:
        """The model of an hf:// source whose config.json is the model's (fetched alone, or
        read from the cache offline); None otherwise. The revision is resolved either way, so a
        wrong name or a missing token fails before anything else."""
        hf = spec.model.hf
        if hf is None:
            return None
        options = self.options(spec)
        try:
            if self.offline:
                found = cached(hf, options)
                snapshot = found.snapshot
                config = found.path / CONFIG_FILE
                text = config.read_text(encoding="utf-8") if spec.model.config_from_origin else ""
            else:
                snapshot = resolve(hf, endpoint=options.endpoint, token=options.token)
                text = (
                    read_text(snapshot, CONFIG_FILE, endpoint=options.endpoint, token=options.token)
                    if spec.model.config_from_origin
                    else ""
                )
        except (FetchError, OSError) as exc:
            raise MemoryPlanError(f"{SOURCE_FIELD}: {exc}") from exc
        self._resolved[hf.uri] = snapshot
        if not spec.model.config_from_origin:
            return None
        print(
            f"dsv4 up: {hf.uri} is {snapshot.commit}: planning from its config.json", file=self.out
        )
        return model_from_config_text(spec, text, name=hf.repo_id.rsplit("/", 1)[-1])

    def files(self, spec: DeploymentSpec, model: ModelConfig) -> ModelFiles | None:
        """Every file of an hf:// source in the local cache, verified, at the commit
        `model_for` resolved; then its tensors against the plan of `model`. None for other
        sources (their files are where the spec says)."""
        hf = spec.model.hf
        if hf is None:
            return None
        snapshot = self._resolved.get(hf.uri)
        source = hf.at(snapshot.commit) if snapshot is not None else hf
        where = self.options(spec).cache_dir
        if self.offline:
            doing = f"taking {hf.uri} from {where} (--offline)"
        else:
            doing = f"fetching {hf.uri} into {where}"
        print(f"dsv4 up: {doing}", file=self.out)
        done, status = fetch_with_progress(
            source, self.options(spec), out=self.out, say_failure=False
        )
        if done is None:
            raise WeightsError(f"{SOURCE_FIELD}: {status.reason}: {status.message}")
        # Fetched at the commit the plan was made for: the ref says which one `hf` named.
        RepoCache(self.options(spec).cache_dir, hf.repo_id).write_ref(
            hf.revision, done.snapshot.commit
        )
        try:
            index = read_index(done.path)
        except FetchError as exc:
            raise WeightsError(f"{SOURCE_FIELD}: {exc}") from exc
        draft = spec.speculative_draft_tokens > 0
        mismatch = (
            first_mismatch(model, index, with_draft=draft) if published_names(index) else None
        )
        if mismatch is not None:
            raise WeightsError(
                f"{SOURCE_FIELD}: {hf.uri}: the checkpoint does not hold what the plan counts: "
                f"{mismatch.message}"
            )
        return ModelFiles(
            str(done.path), config_from_dir=spec.model.config_from_origin, served_name=hf.repo_id
        )
