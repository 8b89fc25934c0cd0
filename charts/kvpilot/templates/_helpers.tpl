{{/* Names and labels shared by the templates. */}}
{{- define "kvpilot.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "kvpilot.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{- define "kvpilot.labels" -}}
{{ include "kvpilot.selectorLabels" . }}
app.kubernetes.io/part-of: kvpilot
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "kvpilot.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "kvpilot.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* The permissions the operator needs in every namespace it serves (see docs/operator.md). */}}
{{- define "kvpilot.namespacedRules" -}}
- apiGroups: [serving.kvpilot.io]
  resources: [llmdeployments]
  verbs: [get, list, watch, patch]
- apiGroups: [serving.kvpilot.io]
  resources: [llmdeployments/status]
  verbs: [get, patch]
- apiGroups: [apps]
  resources: [deployments]
  verbs: [get, list, watch, create, patch, delete]
- apiGroups: [leaderworkerset.x-k8s.io]
  resources: [leaderworkersets]
  verbs: [get, list, watch, create, patch, delete]
- apiGroups: [""]
  resources: [services]
  verbs: [get, list, watch, create, patch, delete]
- apiGroups: [policy]
  resources: [poddisruptionbudgets]
  verbs: [get, list, watch, create, patch, delete]
# The autoscaler lists the engine pods to scrape their /metrics, and annotates them with
# controller.kubernetes.io/pod-deletion-cost before lowering replicas; the operator watches
# them for engines that refuse to start (the ModelLoaded condition).
- apiGroups: [""]
  resources: [pods]
  verbs: [list, watch, patch]
# Other autoscalers (HPAs, KEDA ScaledObjects) whose scaleTargetRef reaches an LLMDeployment or
# its workload: the operator then leaves the replicas to them (docs/autoscaling.md). KEDA acts
# through an HPA it creates, so watching HPAs sees ScaledObjects come and go too.
- apiGroups: [autoscaling]
  resources: [horizontalpodautoscalers]
  verbs: [list, watch]
- apiGroups: [keda.sh]
  resources: [scaledobjects]
  verbs: [list]
# Events on the LLMDeployment: rescales, failures (kopf's and the operator's).
- apiGroups: [""]
  resources: [events]
  verbs: [create]
{{- /* Namespaced peering objects are used only when watching namespaces. */}}
{{- if and .Values.peering.enabled .Values.watchNamespaces }}
- apiGroups: [kopf.dev]
  resources: [kopfpeerings]
  verbs: [get, list, watch, patch]
{{- end }}
{{- end -}}
