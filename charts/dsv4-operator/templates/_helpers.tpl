{{/* Chart name, truncated to a DNS label. */}}
{{- define "dsv4-operator.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Full name: release + chart unless the release name already contains the chart name. */}}
{{- define "dsv4-operator.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "dsv4-operator.selectorLabels" -}}
app.kubernetes.io/name: {{ include "dsv4-operator.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "dsv4-operator.labels" -}}
{{ include "dsv4-operator.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: dsv4-serve
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{/* An image reference from (list <values with repository, tag, digest> <appVersion>):
repository@digest when a digest is given, else repository:tag (default tag: appVersion). */}}
{{- define "dsv4-operator.image" -}}
{{- $image := index . 0 -}}
{{- if $image.digest -}}
{{- printf "%s@%s" $image.repository $image.digest -}}
{{- else -}}
{{- printf "%s:%s" $image.repository (toString (default (index . 1) $image.tag)) -}}
{{- end -}}
{{- end -}}

{{- define "dsv4-operator.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "dsv4-operator.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* Namespaces served, as a JSON list; empty list = cluster-wide. */}}
{{- define "dsv4-operator.namespaces" -}}
{{- if .Values.watch.namespaces -}}
{{- toJson .Values.watch.namespaces -}}
{{- else if .Values.rbac.namespaced -}}
{{- toJson (list .Release.Namespace) -}}
{{- else -}}
[]
{{- end -}}
{{- end -}}

{{/* The rules the operator needs on the objects it plans, in every namespace it serves:
exactly the verbs its code uses (operator/tests/test_chart_verbs.py reads them from the code). */}}
{{- define "dsv4-operator.workloadRules" -}}
# kopf watches its CRs (list, watch) and patches its finalizer and annotations in; each
# reconcile reads its CR afresh (get) and writes status (patch on /status).
- apiGroups: [serving.dsv4.io]
  resources: [dsv4deployments]
  verbs: [get, list, watch, patch]
- apiGroups: [serving.dsv4.io]
  resources: [dsv4deployments/status]
  verbs: [patch]
# Children carry ownerReferences with blockOwnerDeletion: true; clusters that enforce
# OwnerReferencesPermissionEnforcement (OpenShift) require update on the owner's finalizers.
- apiGroups: [serving.dsv4.io]
  resources: [dsv4deployments/finalizers]
  verbs: [update]
# The children: server-side applied (create, patch), listed to prune and deleted when no longer
# planned (delete also lets an update change their ownerReferences). No get and no watch: the
# reconcile lists them, and kopf watches none of these.
- apiGroups: [apps]
  resources: [statefulsets]
  verbs: [list, create, patch, delete]
- apiGroups: [""]
  resources: [services, serviceaccounts]
  verbs: [list, create, patch, delete]
# The deployment's PD secret: created once (an existing one is left alone); never read back,
# listed, changed or deleted (its ownerReference deletes it with the DSV4Deployment). get: by
# name, only the Secret an hf:// source's spec.model.hub.tokenSecretRef names (its HF_TOKEN);
# never list or watch.
- apiGroups: [""]
  resources: [secrets]
  verbs: [create, get]
- apiGroups: [policy]
  resources: [poddisruptionbudgets]
  verbs: [list, create, patch, delete]
- apiGroups: [networking.k8s.io]
  resources: [networkpolicies]
  verbs: [list, create, patch, delete]
# PodGroups of gang-scheduled PP groups (spec.scheduling.gang: Volcano, scheduler-plugins).
- apiGroups: [scheduling.volcano.sh, scheduling.x-k8s.io]
  resources: [podgroups]
  verbs: [list, create, patch, delete]
# The Gateway API Inference Extension's objects (spec.gateway): an InferencePool, an HTTPRoute.
- apiGroups: [inference.networking.k8s.io]
  resources: [inferencepools]
  verbs: [list, create, patch, delete]
- apiGroups: [gateway.networking.k8s.io]
  resources: [httproutes]
  verbs: [list, create, patch, delete]
# spec.autoscaling.engine hpa|keda: each role's DSV4RoleScaler (read for the replicas the HPA
# set), its HorizontalPodAutoscaler or KEDA ScaledObject.
- apiGroups: [serving.dsv4.io]
  resources: [dsv4rolescalers]
  verbs: [get, list, create, patch, delete]
- apiGroups: [autoscaling]
  resources: [horizontalpodautoscalers]
  verbs: [list, create, patch, delete]
- apiGroups: [keda.sh]
  resources: [scaledobjects]
  verbs: [list, create, patch, delete]
# The router Deployment and the config ConfigMap are children too; kopf also watches both (the
# router's readiness, a configMapRef's edits), and the reconcile reads the router (get) and a
# configMapRef's ConfigMap (get).
- apiGroups: [apps]
  resources: [deployments]
  verbs: [get, list, watch, create, patch, delete]
- apiGroups: [""]
  resources: [configmaps]
  verbs: [get, list, watch, create, patch, delete]
# Worker pods: watched (a failed or restarted pod), listed (observed), a PP group's deleted at
# once (deletecollection) when it restarts as a unit.
- apiGroups: [""]
  resources: [pods]
  verbs: [list, watch, deletecollection]
- apiGroups: [""]
  resources: [events]
  verbs: [create]
# hf:// sources (spec.model.source): the shared download Job (listed by its key, applied,
# deleted to recreate or prune; kopf watches its events) and the cache claim the operator
# creates (and one a CR names, read).
- apiGroups: [batch]
  resources: [jobs]
  verbs: [list, watch, create, patch, delete]
- apiGroups: [""]
  resources: [persistentvolumeclaims]
  verbs: [get, list, create, patch, delete]
{{- end -}}

{{/* The admission webhook's Service, and the Secret holding its serving certificate. */}}
{{- define "dsv4-operator.webhookService" -}}
{{- printf "%s-webhook" (include "dsv4-operator.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "dsv4-operator.webhookSecret" -}}
{{- printf "%s-webhook-tls" (include "dsv4-operator.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* podSecurity.level, checked: one of the three, and the CRD's rules must be able to follow it
(the crds/ copy holds restricted's: another level needs the templated CRD, crds.manage). */}}
{{- define "dsv4-operator.podSecurityLevel" -}}
{{- $level := .Values.podSecurity.level | toString -}}
{{- if not (has $level (list "restricted" "baseline" "privileged")) -}}
{{- fail (printf "podSecurity.level must be restricted, baseline or privileged, got %q" $level) -}}
{{- end -}}
{{- if and (ne $level "restricted") (not .Values.crds.manage) -}}
{{- fail (printf "podSecurity.level=%s needs crds.manage=true: the CRD in crds/ holds the rules of restricted, and Helm never templates crds/ (install with --skip-crds, see README.md)" $level) -}}
{{- end -}}
{{- $level -}}
{{- end -}}
