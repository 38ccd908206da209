{{/* The worker roles, in the order their groups are rendered. */}}
{{- define "tessera.roles" -}}
mixed prefill decode
{{- end }}

{{/* The RayService's name. KubeRay derives longer names from it (<name>-raycluster-xxxxx,
pods, <name>-serve-svc), so it stays short. */}}
{{- define "tessera.fullname" -}}
{{- if contains .Chart.Name .Release.Name }}
{{- .Release.Name | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 40 | trimSuffix "-" }}
{{- end }}
{{- end }}

{{- define "tessera.serveServiceName" -}}
{{ include "tessera.fullname" . }}-serve-svc
{{- end }}

{{- define "tessera.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/* Pod labels leave out app.kubernetes.io/name: KubeRay sets its own on the pods it makes. */}}
{{- define "tessera.podLabels" -}}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/part-of: {{ .Chart.Name }}
{{- end }}

{{/* Non-empty when an enabled worker group has GPUs. */}}
{{- define "tessera.gpu" -}}
{{- range $role := splitList " " (include "tessera.roles" .) }}
{{- $group := index $.Values.workerGroups $role }}
{{- if and $group.enabled (gt (int $group.gpus) 0) }}{{ $role }} {{ end }}
{{- end }}
{{- end }}

{{- define "tessera.image" -}}
{{- $variant := ternary "gpu" "cpu" (ne (include "tessera.gpu" .) "") }}
{{- $tag := .Values.image.tag | default (printf "%s-%s" .Chart.AppVersion $variant) }}
{{- printf "%s:%s" .Values.image.repository $tag }}
{{- end }}

{{/* What values.schema.json cannot say: relations between values. */}}
{{- define "tessera.validate" -}}
{{- $enabled := list }}
{{- range $role, $group := .Values.workerGroups }}
{{- if $group.enabled }}{{ $enabled = append $enabled $role }}{{ end }}
{{- end }}
{{- if not $enabled }}
{{- fail "workerGroups: no worker group is enabled" }}
{{- end }}
{{- $tessera := .Values.tessera }}
{{- $needed := dict
  "mixed" (max (int $tessera.workers) (int ($tessera.max_workers | default 0)))
  "prefill" (max (int ($tessera.prefill_workers | default 0)) (int ($tessera.max_prefill_workers | default 0)))
  "decode" (max (int ($tessera.decode_workers | default 0)) (int ($tessera.max_decode_workers | default 0))) }}
{{- $fields := dict "mixed" "workers" "prefill" "prefill_workers" "decode" "decode_workers" }}
{{- range $role := splitList " " (include "tessera.roles" .) }}
{{- $group := index $.Values.workerGroups $role }}
{{- $where := printf "workerGroups.%s" $role }}
{{- $capacity := 0 }}
{{- if $group.enabled }}
{{- $capacity = mul $group.maxReplicas $group.workersPerPod }}
{{- if gt (int $group.minReplicas) (int $group.maxReplicas) }}
{{- fail (printf "%s: minReplicas (%d) is above maxReplicas (%d)" $where (int $group.minReplicas) (int $group.maxReplicas)) }}
{{- end }}
{{- if or (lt (int $group.replicas) (int $group.minReplicas)) (gt (int $group.replicas) (int $group.maxReplicas)) }}
{{- fail (printf "%s: replicas (%d) must be between minReplicas (%d) and maxReplicas (%d)" $where (int $group.replicas) (int $group.minReplicas) (int $group.maxReplicas)) }}
{{- end }}
{{- $ranks := int ($tessera.tensor_parallel_size | default 1) }}
{{- if and (gt (int $group.gpus) 0) (eq $ranks 1) (gt (int $group.workersPerPod) (int $group.gpus)) }}
{{- fail (printf "%s: workersPerPod (%d) is above gpus (%d); each worker takes one GPU" $where (int $group.workersPerPod) (int $group.gpus)) }}
{{- end }}
{{- if and (gt (int $group.gpus) 0) (gt $ranks 1) (gt (mul (int $group.workersPerPod) $ranks) (int $group.gpus)) }}
{{- fail (printf "%s: workersPerPod (%d) x tensor_parallel_size (%d) is above gpus (%d); each rank of a worker group takes one GPU on the same node" $where (int $group.workersPerPod) $ranks (int $group.gpus)) }}
{{- end }}
{{- end }}
{{- $want := index $needed $role }}
{{- if gt (int $want) (int $capacity) }}
{{- if $group.enabled }}
{{- fail (printf "tessera.%s: %d %s workers do not fit %s (maxReplicas %d x workersPerPod %d = %d)" (index $fields $role) (int $want) $role $where (int $group.maxReplicas) (int $group.workersPerPod) (int $capacity)) }}
{{- else }}
{{- fail (printf "tessera.%s: %d %s workers need %s, which is disabled" (index $fields $role) (int $want) $role $where) }}
{{- end }}
{{- end }}
{{- end }}
{{- if and (ne .Values.model.source "image") (not $tessera.model) }}
{{- fail (printf "tessera.model: give the model's path under %s (model.source is %s)" .Values.model.mountPath .Values.model.source) }}
{{- end }}
{{- $gpu := ne (include "tessera.gpu" .) "" }}
{{- $device := $tessera.device | default "auto" }}
{{- if and $gpu (ne $device "cuda") }}
{{- fail (printf "tessera.device: worker groups have GPUs, so device must be cuda, got %s (auto picks the CPU while no GPU pod has started yet)" $device) }}
{{- end }}
{{- if and (not $gpu) (eq $device "cuda") }}
{{- fail "tessera.device: cuda needs a worker group with gpus > 0" }}
{{- end }}
{{- end }}

{{/* Serve's config (serveConfigV2): the app with Tessera's settings as args. */}}
{{- define "tessera.serveConfig" -}}
{{- $args := deepCopy .Values.tessera }}
{{- /* Worker actors ask for the tessera-<role> resource that only their group offers. */}}
{{- $_ := set $args "role_resources" true }}
{{- /* Prefill workers listen on the pod's interfaces and advertise the node's IP. */}}
{{- $_ := set $args "kv_transfer_host" "0.0.0.0" }}
{{- with .Values.kvTransferTLS }}
{{- if .enabled }}
{{- $_ := set $args "kv_transfer_tls_cert" (printf "%s/tls.crt" .mountPath) }}
{{- $_ := set $args "kv_transfer_tls_key" (printf "%s/tls.key" .mountPath) }}
{{- $_ := set $args "kv_transfer_tls_ca" (printf "%s/ca.crt" .mountPath) }}
{{- $_ := set $args "kv_transfer_tls_server_name" .serverName }}
{{- end }}
{{- end }}
{{- $app := dict
  "name" "tessera"
  "route_prefix" "/"
  "import_path" "tessera.cluster.serve_app:app_builder"
  "args" $args }}
{{- $config := dict
  "proxy_location" .Values.serve.proxyLocation
  "http_options" (dict "host" "0.0.0.0" "port" .Values.tessera.port)
  "applications" (list $app) }}
{{- if .Values.tessera.grpc_port }}
{{- $_ := set $config "grpc_options" (dict
  "port" .Values.tessera.grpc_port
  "grpc_servicer_functions" .Values.serve.grpcServicerFunctions) }}
{{- end }}
{{- toYaml $config }}
{{- end }}

{{/* Environment of every Ray container: the caches on their emptyDir. */}}
{{- define "tessera.env" -}}
- name: XDG_CACHE_HOME
  value: {{ .Values.security.cachePath }}
- name: TRITON_CACHE_DIR
  value: {{ printf "%s/triton" .Values.security.cachePath }}
{{- /* Serve's gRPC proxy reads no larger message than a request body may be */}}
- name: RAY_SERVE_GRPC_MAX_MESSAGE_SIZE
  value: {{ include "tessera.bytes" (.Values.tessera.max_request_bytes | default "4MiB") | quote }}
{{- end }}

{{/* A size as Tessera's settings take it ('4MiB', '512KiB', '4MB' or a number of bytes;
case and a trailing B ignored; whole numbers here), in bytes. */}}
{{- define "tessera.bytes" -}}
{{- $text := toString . | trim -}}
{{- $number := regexFind "^[0-9]+" $text -}}
{{- $unit := trimPrefix $number $text | trim | lower | trimSuffix "b" -}}
{{- $scale := dict "" 1 "k" 1000 "m" 1000000 "g" 1000000000 "ki" 1024 "mi" 1048576 "gi" 1073741824 -}}
{{- if or (not $number) (not (hasKey $scale $unit)) -}}
{{- fail (printf "tessera.max_request_bytes: %q is not a size (a whole number of bytes, or with KiB, MiB, GiB, KB, MB or GB)" $text) -}}
{{- end -}}
{{- mul (int64 $number) (get $scale $unit) -}}
{{- end }}

{{/* The API key, for the head's container only: KubeRay deploys the app there (which reads
it), and the front-end replicas get it with their deployment. */}}
{{- define "tessera.apiKeyEnv" -}}
{{- if .Values.apiKey.secretName }}
- name: TESSERA_API_KEY
  valueFrom:
    secretKeyRef:
      name: {{ .Values.apiKey.secretName }}
      key: {{ .Values.apiKey.secretKey }}
{{- end }}
{{- end }}

{{/* Every container's securityContext. */}}
{{- define "tessera.containerSecurityContext" -}}
securityContext:
  {{- toYaml .Values.security.containerSecurityContext | nindent 2 }}
{{- end }}

{{- define "tessera.volumeMounts" -}}
- name: tmp
  mountPath: /tmp
- name: cache
  mountPath: {{ .Values.security.cachePath }}
{{- if ne .Values.model.source "image" }}
- name: model
  mountPath: {{ .Values.model.mountPath }}
  readOnly: true
{{- end }}
{{- if .Values.kvTransferTLS.enabled }}
- name: kv-tls
  mountPath: {{ .Values.kvTransferTLS.mountPath }}
  readOnly: true
{{- end }}
{{- end }}

{{- define "tessera.volumes" -}}
- name: tmp
  emptyDir: {}
- name: cache
  emptyDir: {}
{{- if eq .Values.model.source "pvc" }}
- name: model
  persistentVolumeClaim:
    claimName: {{ .Values.model.pvc.claimName }}
    readOnly: true
{{- else if eq .Values.model.source "hostPath" }}
- name: model
  hostPath:
    path: {{ .Values.model.hostPath.path }}
    type: Directory
{{- end }}
{{- if .Values.kvTransferTLS.enabled }}
- name: kv-tls
  secret:
    secretName: {{ .Values.kvTransferTLS.secretName }}
{{- end }}
{{- end }}

{{/* Pod spec fields shared by the head and the workers: the pod's securityContext, volumes,
pull secrets, placement.
Takes (dict "root" $ "placement" <head or worker group values>). */}}
{{- define "tessera.podExtras" -}}
securityContext:
  {{- toYaml .root.Values.security.podSecurityContext | nindent 2 }}
volumes:
  {{- include "tessera.volumes" .root | trim | nindent 2 }}
{{- with .root.Values.image.pullSecrets }}
imagePullSecrets:
{{- toYaml . | nindent 2 }}
{{- end }}
{{- with .placement.nodeSelector }}
nodeSelector:
{{- toYaml . | nindent 2 }}
{{- end }}
{{- with .placement.tolerations }}
tolerations:
{{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}
