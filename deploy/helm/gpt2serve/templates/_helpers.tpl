{{- define "gpt2serve.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "gpt2serve.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "gpt2serve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "gpt2serve.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "gpt2serve.labels" -}}
{{ include "gpt2serve.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "gpt2serve.image" -}}
{{- $tag := .Values.image.tag | default (ternary .Chart.AppVersion (printf "%s-cpu" .Chart.AppVersion) .Values.gpu.enabled) -}}
{{- printf "%s:%s" .Values.image.repository $tag -}}
{{- end -}}

{{/* SIGTERM comes after the preStop sleep; the drain must fit before the kubelet's SIGKILL. */}}
{{- define "gpt2serve.terminationGracePeriodSeconds" -}}
{{- add .Values.preStopSleepSeconds .Values.shutdownGraceSeconds .Values.terminationMarginSeconds -}}
{{- end -}}

{{- define "gpt2serve.scheme" -}}
{{- if .Values.tls.existingSecret }}HTTPS{{ else }}HTTP{{ end -}}
{{- end -}}

{{/* What autoscaling sums: requests waiting on every replica of this release. */}}
{{- define "gpt2serve.autoscalingQuery" -}}
{{- .Values.autoscaling.query | default (printf "sum(gpt2serve_requests_waiting{namespace=\"%s\",service=\"%s\"})" .Release.Namespace (include "gpt2serve.fullname" .)) -}}
{{- end -}}
