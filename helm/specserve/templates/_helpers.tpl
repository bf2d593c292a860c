{{/*
Names and labels shared by every template.
*/}}

{{/* The chart name, or nameOverride. */}}
{{- define "specserve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The full name: fullnameOverride, or "<release>-<name>" (just the release when it contains the name). */}}
{{- define "specserve.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* "name-version" for the helm.sh/chart label. */}}
{{- define "specserve.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels on every object of the release. */}}
{{- define "specserve.baseLabels" -}}
helm.sh/chart: {{ include "specserve.chart" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: specserve
{{- end }}

{{/* Labels of objects that belong to no one component (ConfigMap, Secret, ...). */}}
{{- define "specserve.labels" -}}
{{ include "specserve.baseLabels" . }}
app.kubernetes.io/name: {{ include "specserve.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/* Labels of the server's objects (Deployment, pods, Service, ...). */}}
{{- define "specserve.serverLabels" -}}
{{ include "specserve.baseLabels" . }}
{{ include "specserve.selectorLabels" . }}
{{- end }}

{{/* Labels of the in-chart Redis objects. */}}
{{- define "specserve.redis.labels" -}}
{{ include "specserve.baseLabels" . }}
{{ include "specserve.redis.selectorLabels" . }}
{{- end }}

{{/* Selector labels of the server pods (immutable once deployed). */}}
{{- define "specserve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "specserve.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: server
{{- end }}

{{/* Selector labels of the in-chart Redis. */}}
{{- define "specserve.redis.selectorLabels" -}}
app.kubernetes.io/name: {{ include "specserve.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: redis
{{- end }}

{{/* Name of the in-chart Redis Deployment and Service. */}}
{{- define "specserve.redis.fullname" -}}
{{- printf "%s-redis" (include "specserve.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The ServiceAccount the pods run as. */}}
{{- define "specserve.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "specserve.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* The server image reference. */}}
{{- define "specserve.image" -}}
{{- $tag := .Values.image.tag }}
{{- if not $tag }}
{{- $tag = ternary (printf "%s-gpu" .Chart.AppVersion) .Chart.AppVersion .Values.gpu.enabled }}
{{- end }}
{{- printf "%s:%s" .Values.image.repository $tag }}
{{- end }}

{{/* The Secret that holds the API keys, or "" when there are none. */}}
{{- define "specserve.apiKeysSecret" -}}
{{- if .Values.apiKeys.existingSecret }}
{{- .Values.apiKeys.existingSecret }}
{{- else if .Values.apiKeys.keys }}
{{- printf "%s-api-keys" (include "specserve.fullname" .) }}
{{- end }}
{{- end }}

{{/* Whether a Redis URL comes from anywhere ("true" or ""). */}}
{{- define "specserve.redis.enabled" -}}
{{- if or .Values.redis.url .Values.redis.existingSecret .Values.redis.internal.enabled }}true{{ end }}
{{- end }}

{{/* Whether config.target names the default model ("true" or ""). */}}
{{- define "specserve.defaultTarget" -}}
{{- if has .Values.config.target (list "default" "SmolLM2-135M-Instruct" "smollm2-135m-instruct" "smollm2-135m") }}true{{ end }}
{{- end }}

{{/* The name of the model volume's claim. */}}
{{- define "specserve.pvcName" -}}
{{- default (printf "%s-models" (include "specserve.fullname" .)) .Values.model.persistence.existingClaim }}
{{- end }}

{{/* Grace period: explicit, or preStop sleep + drain timeout + margin. */}}
{{- define "specserve.terminationGracePeriodSeconds" -}}
{{- if kindIs "invalid" .Values.terminationGracePeriodSeconds }}
{{- add .Values.preStopSleepSeconds .Values.config.shutdownTimeout 15 }}
{{- else }}
{{- .Values.terminationGracePeriodSeconds }}
{{- end }}
{{- end }}
