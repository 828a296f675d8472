{{/* Base of every object's name: "<release>" (at most 40 characters, so that
"<base>-control-plane" and the Tritons' pod host names stay DNS labels). */}}
{{- define "mmserve.fullname" -}}
{{- default .Release.Name .Values.fullnameOverride | trunc 40 | trimSuffix "-" -}}
{{- end -}}

{{- define "mmserve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "mmserve.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/name: {{ include "mmserve.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{/* Selector labels of one component: include "mmserve.selector" (list . "router") */}}
{{- define "mmserve.selector" -}}
{{- $root := index . 0 -}}
app.kubernetes.io/name: {{ include "mmserve.name" $root }}
app.kubernetes.io/instance: {{ $root.Release.Name }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end -}}

{{- define "mmserve.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{- define "mmserve.tritonService" -}}{{ include "mmserve.fullname" . }}-triton{{- end -}}
{{- define "mmserve.adminService" -}}{{ include "mmserve.fullname" . }}-admin{{- end -}}
{{- define "mmserve.modelsClaim" -}}
{{- default (printf "%s-models" (include "mmserve.fullname" .)) .Values.repository.existingClaim -}}
{{- end -}}
{{- define "mmserve.coldClaim" -}}
{{- default (printf "%s-cold" (include "mmserve.fullname" .)) .Values.coldStore.existingClaim -}}
{{- end -}}

{{/* Secrets: a user's existingSecret, else the one the chart keeps. */}}
{{- define "mmserve.adminTokenSecret" -}}
{{- default (printf "%s-admin-token" (include "mmserve.fullname" .)) .Values.adminToken.existingSecret -}}
{{- end -}}
{{- define "mmserve.dataplaneTokenSecret" -}}
{{- default (printf "%s-dataplane-token" (include "mmserve.fullname" .)) .Values.dataplaneToken.existingSecret -}}
{{- end -}}
{{- define "mmserve.tritonKeySecret" -}}
{{- default (printf "%s-triton-admin-key" (include "mmserve.fullname" .)) .Values.triton.adminKey.existingSecret -}}
{{- end -}}
{{- define "mmserve.postgresSecret" -}}
{{- if and .Values.postgres.existingSecret .Values.postgres.url -}}
{{- fail "postgres: give either postgres.existingSecret (a Secret holding the URL) or postgres.url, not both" -}}
{{- end -}}
{{- if not (or .Values.postgres.existingSecret .Values.postgres.url) -}}
{{- fail "postgres: the control plane keeps its state in PostgreSQL; set postgres.existingSecret (a Secret with the URL under postgres.key) or postgres.url (postgresql://user:password@host:5432/db)" -}}
{{- end -}}
{{- default (printf "%s-postgres" (include "mmserve.fullname" .)) .Values.postgres.existingSecret -}}
{{- end -}}

{{/* A generated secret value that survives upgrades: the live Secret's value when there is
one (lookup), else a new random one.  include "mmserve.keptRandom" (list . secretName key) */}}
{{- define "mmserve.keptRandom" -}}
{{- $root := index . 0 -}}
{{- $live := lookup "v1" "Secret" $root.Release.Namespace (index . 1) -}}
{{- if and $live $live.data (hasKey $live.data (index . 2)) -}}
{{- index $live.data (index . 2) -}}
{{- else -}}
{{- randAlphaNum 48 | b64enc -}}
{{- end -}}
{{- end -}}

{{/* What every pod spec shares: no Kubernetes API token (nothing here calls the API), no
service-link env vars (a Service named like a product variable must not set one), the
values' pod security context, scheduling and grace period.
include "mmserve.podCommon" (dict "root" . "values" .Values.<component>) */}}
{{- define "mmserve.podCommon" -}}
automountServiceAccountToken: false
enableServiceLinks: false
{{- with .root.Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
securityContext:
  {{- toYaml .values.podSecurityContext | nindent 2 }}
{{- with .values.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .values.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
terminationGracePeriodSeconds: {{ .values.terminationGracePeriodSeconds }}
{{- end -}}

{{/* NetworkPolicy peer: Prometheus' pods. */}}
{{- define "mmserve.monitoringPeer" -}}
- namespaceSelector:
    {{- toYaml .Values.metrics.namespaceSelector | nindent 4 }}
  {{- with .Values.metrics.podSelector }}
  podSelector:
    {{- toYaml . | nindent 4 }}
  {{- end }}
{{- end -}}
