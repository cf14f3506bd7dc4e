{{/* Names and labels, in the usual `helm create` shape. */}}
{{- define "mtpserve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Full name. Kept to 40 characters: KubeRay derives RayCluster, pod and Service names from the
RayService name (adding a hash and group suffixes) and those must stay within 63.
*/}}
{{- define "mtpserve.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "mtpserve.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "mtpserve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "mtpserve.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "mtpserve.labels" -}}
helm.sh/chart: {{ include "mtpserve.chart" . }}
{{ include "mtpserve.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "mtpserve.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{- define "mtpserve.authSecretName" -}}
{{- default (printf "%s-api-key" (include "mtpserve.fullname" .)) .Values.auth.existingSecret }}
{{- end }}

{{/* The KubeRay-managed serve Service (fixed name, so Ingress/HTTPRoute can point at it). */}}
{{- define "mtpserve.serveServiceName" -}}
{{- printf "%s-serve-svc" (include "mtpserve.fullname" .) }}
{{- end }}

{{/* The head's service account; empty means the namespace default (KubeRay binds to it). */}}
{{- define "mtpserve.headServiceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (printf "%s-head" (include "mtpserve.fullname" .)) .Values.serviceAccount.name }}
{{- else }}
{{- .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "mtpserve.modelClaimName" -}}
{{- default (printf "%s-model" (include "mtpserve.fullname" .)) .Values.model.pvc.claimName }}
{{- end }}

{{- define "mtpserve.httpPort" -}}
{{- (.Values.serve.args.http | default dict).port | default 8000 | int }}
{{- end }}

{{/* Where an hf download lands: one folder per repository below the mount. */}}
{{- define "mtpserve.hfModelDir" -}}
{{- printf "%s/%s" (.Values.model.mountPath | trimSuffix "/") (.Values.model.hf.repo | replace "/" "--") }}
{{- end }}

{{/* Seconds the old RayCluster outlives an upgrade: running requests may take request_timeout_s. */}}
{{- define "mtpserve.deletionDelay" -}}
{{- $d := .Values.upgrade.rayClusterDeletionDelaySeconds }}
{{- if kindIs "invalid" $d }}
{{- add (ceil (.Values.serve.args.request_timeout_s | default 600)) 30 }}
{{- else }}
{{- $d | int }}
{{- end }}
{{- end }}

{{/*
Drain deadline of a worker pod (seconds): what its preStop hook gives Ray and Serve to move the
replicas off the pod (Ray's drain API, deadline included). Serve starts replacements elsewhere and
stops a replica at the latest `graceful_shutdown_timeout_s` before the deadline, so that replica
still gets its whole graceful shutdown. Empty derives replicaStartSeconds + the shutdown timeout;
with an explicit terminationGracePeriodSeconds, what it leaves after stopSeconds + 10.
*/}}
{{- define "mtpserve.drainDeadline" -}}
{{- $d := .Values.drain }}
{{- $shutdown := .Values.serve.args.graceful_shutdown_timeout_s | default 30 | float64 }}
{{- if not (kindIs "invalid" $d.deadlineSeconds) }}
{{- $d.deadlineSeconds | int }}
{{- else if not (kindIs "invalid" .Values.terminationGracePeriodSeconds) }}
{{- max 0 (sub (int .Values.terminationGracePeriodSeconds) (add (int $d.stopSeconds) 10)) }}
{{- else }}
{{- add (int $d.replicaStartSeconds) (ceil $shutdown) }}
{{- end }}
{{- end }}

{{/*
Pod grace period. Workers: the drain deadline, 5 s more for the hook's drain part to end (it is
killed by then), `ray stop` (stopSeconds) and 5 s for `ray stop` itself. Head (no preStop):
Serve's graceful_shutdown_timeout_s plus 30 s. An explicit terminationGracePeriodSeconds
applies to all.
*/}}
{{- define "mtpserve.gracePeriod" -}}
{{- $g := .root.Values.terminationGracePeriodSeconds }}
{{- if not (kindIs "invalid" $g) }}
{{- $g | int }}
{{- else if .head }}
{{- add (ceil (.root.Values.serve.args.graceful_shutdown_timeout_s | default 30)) 30 }}
{{- else }}
{{- add (include "mtpserve.drainDeadline" .root | int) .root.Values.drain.stopSeconds 10 }}
{{- end }}
{{- end }}

{{/* A Kubernetes quantity ("32Gi", "1.5G", 1024) in bytes, as an integer. */}}
{{- define "mtpserve.bytes" -}}
{{- $q := toString . | trim }}
{{- if not (regexMatch "^[0-9]+(\\.[0-9]+)?(Ki|Mi|Gi|Ti|Pi|k|K|M|G|T|P)?$" $q) }}
{{- fail (printf "%q is not a memory quantity the chart can read (e.g. 512Mi, 32Gi, 8G)" $q) }}
{{- end }}
{{- $num := regexFind "^[0-9]+(\\.[0-9]+)?" $q | float64 }}
{{- $suffix := trimPrefix (regexFind "^[0-9]+(\\.[0-9]+)?" $q) $q }}
{{- $mul := get (dict "" 1.0 "Ki" 1024.0 "Mi" 1048576.0 "Gi" 1073741824.0 "Ti" 1099511627776.0 "Pi" 1125899906842624.0 "k" 1000.0 "K" 1000.0 "M" 1000000.0 "G" 1000000000.0 "T" 1000000000000.0 "P" 1000000000000000.0) $suffix }}
{{- mulf $num $mul | floor | int64 }}
{{- end }}

{{/*
Object store and /dev/shm of one group (head, prefill or decode), as YAML:
objectStoreBytes (rayStartParams object-store-memory) and shmMi (the /dev/shm emptyDir size).
The store is objectStore.memoryFraction of the container's memory (limit, else request), or the
group's own `object-store-memory`; /dev/shm is the store plus sharedMemory.headroom (NCCL's
shared-memory transport and torch IPC also live there). An explicit sharedMemory.sizeLimit caps
the store at that size minus the headroom, so Ray never finds /dev/shm smaller than its store
(it would refuse to start, or put the store on disk).
*/}}
{{- define "mtpserve.groupMemory" -}}
{{- $v := .root.Values }}
{{- $mi := 1048576 }}
{{- $res := .resources | default dict }}
{{- $mem := get ($res.limits | default dict) "memory" | default (get ($res.requests | default dict) "memory") }}
{{- $headroom := include "mtpserve.bytes" $v.sharedMemory.headroom | int64 }}
{{- $store := 0 }}
{{- $given := get (.rayStartParams | default dict) "object-store-memory" }}
{{- if $given }}
{{- $store = $given | int64 }}
{{- else if $mem }}
{{- $store = mulf (include "mtpserve.bytes" $mem | float64) $v.objectStore.memoryFraction | floor | int64 }}
{{- end }}
{{- $shm := 0 }}
{{- if $v.sharedMemory.sizeLimit }}
{{- $shm = include "mtpserve.bytes" $v.sharedMemory.sizeLimit | int64 }}
{{- $cap := max 0 (sub $shm $headroom) }}
{{- if and $given (gt $store $cap) }}
{{- fail (printf "%s.rayStartParams.object-store-memory=%d does not fit sharedMemory.sizeLimit=%v minus sharedMemory.headroom=%v" .where $store $v.sharedMemory.sizeLimit $v.sharedMemory.headroom) }}
{{- end }}
{{- if and (not $given) (or (not $mem) (gt $store $cap)) }}{{ $store = $cap }}{{ end }}
{{- else }}
{{- if not $store }}
{{- fail (printf "%s has no memory limit or request: set one (the object store and /dev/shm are sized from it) or sharedMemory.sizeLimit" .where) }}
{{- end }}
{{- $store = mul (div $store $mi) $mi }}
{{- $shm = add $store $headroom }}
{{- end }}
{{- $store = mul (div $store $mi) $mi }}
{{- if lt $store (mul 100 $mi) }}
{{- fail (printf "%s: Ray's object store would get %d MiB (under 100 MiB): raise the memory, objectStore.memoryFraction or sharedMemory.sizeLimit" .where (div $store $mi)) }}
{{- end }}
objectStoreBytes: {{ $store | quote }}
shmMi: {{ div (add $shm (sub $mi 1)) $mi }}
{{- end }}

{{/*
The application's `args:`: serve.args plus what the chart itself wires (the API key env var, the
downloaded model's folder). A plaintext `auth.api_key` would end up in the RayService object, so
it is refused here.
*/}}
{{- define "mtpserve.serveArgs" -}}
{{- $args := deepCopy .Values.serve.args }}
{{- if and (eq .Values.model.source "hf") (not $args.model) }}
{{- $_ := set $args "model" (include "mtpserve.hfModelDir" .) }}
{{- end }}
{{- if .Values.auth.enabled }}
{{- $auth := deepCopy ($args.auth | default dict) }}
{{- if $auth.api_key }}
{{- fail "serve.args.auth.api_key would store the key in the RayService; use auth.apiKey or auth.existingSecret" }}
{{- end }}
{{- $_ := set $auth "api_key_env" .Values.auth.envName }}
{{- $_ := set $args "auth" $auth }}
{{- end }}
{{- toYaml $args }}
{{- end }}

{{/*
Deployment overrides, as given (serve.deployments). Placement, replicas and resources come from
serve.args through the builder (cluster/app.py); _validate.tpl refuses overrides of them.
*/}}
{{- define "mtpserve.deployments" -}}
{{- toYaml (.Values.serve.deployments | default list) }}
{{- end }}

{{/* The Serve deploy config (ServeDeploySchema) that KubeRay PUTs to the dashboard. */}}
{{- define "mtpserve.serveConfig" -}}
{{- $app := dict "name" "mtpserve" "route_prefix" "/" "import_path" "mtpserve.cluster.app:build_app" }}
{{- $_ := set $app "args" (include "mtpserve.serveArgs" . | fromYaml) }}
{{- $deps := include "mtpserve.deployments" . | fromYamlArray }}
{{- with $deps }}
{{- $_ := set $app "deployments" . }}
{{- end }}
{{- $http := dict "host" "0.0.0.0" "port" (include "mtpserve.httpPort" . | int) }}
{{- $cfg := dict "proxy_location" .Values.serve.proxyLocation "http_options" $http }}
{{- $_ := set $cfg "applications" (list $app) }}
{{- toYaml $cfg }}
{{- end }}

{{/* Environment shared by every Ray container. */}}
{{- define "mtpserve.env" -}}
{{- /* KV senders must listen on an address decode pods on other nodes can reach
(workers/kv_transfer/sender.py reads it unless kv_transfer.host is set). */}}
- name: MTPSERVE_KV_HOST
  valueFrom:
    fieldRef:
      fieldPath: status.podIP
- name: MTPSERVE_POD_IP  # the worker preStop hook finds its Ray node by it
  valueFrom:
    fieldRef:
      fieldPath: status.podIP
{{- /* As `mtpserve up` (cluster/cli_serve.py RAY_ENV): engines at the priority of Ray's
own daemons, not nice 15 below them; a 0.5 s Serve control loop; replica metrics each 1 s;
Serve's gRPC transport from the proxy to the ingress and between deployments; replicas run
our code and Serve's router on their main event loop. */}}
- name: RAY_worker_niceness
  value: "0"
- name: RAY_SERVE_CONTROL_LOOP_INTERVAL_S
  value: "0.5"
- name: RAY_SERVE_METRICS_EXPORT_INTERVAL_MS
  value: "1000"
- name: RAY_SERVE_USE_GRPC_BY_DEFAULT
  value: "1"
- name: RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD
  value: "0"
- name: RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP
  value: "0"
{{- with .Values.network.socketIfname }}
- name: GLOO_SOCKET_IFNAME  # KV channels and TP groups over gloo
  value: {{ . | quote }}
- name: NCCL_SOCKET_IFNAME  # NCCL's bootstrap and socket transport
  value: {{ . | quote }}
{{- end }}
{{- with .Values.network.ncclDebug }}
- name: NCCL_DEBUG
  value: {{ . | quote }}
{{- end }}
{{- with .Values.network.ncclIbHca }}
- name: NCCL_IB_HCA
  value: {{ . | quote }}
{{- end }}
{{- if .Values.auth.enabled }}
- name: {{ .Values.auth.envName }}
  valueFrom:
    secretKeyRef:
      name: {{ include "mtpserve.authSecretName" . }}
      key: {{ .Values.auth.secretKey }}
{{- end }}
{{- if ne .Values.compileCache.type "none" }}
- name: MTPSERVE_COMPILE_CACHE  # the engines' default compile_cache_dir
  value: {{ .Values.compileCache.mountPath | quote }}
{{- end }}
{{- with .Values.network.env }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/*
Whether the model reaches this pod: pods that run model replicas (workers, and the head unless
it advertises no CPUs) get the model volume and, for source hf, the download. `.replicas` says.
*/}}
{{- define "mtpserve.hasModel" -}}
{{- if and .replicas (ne .root.Values.model.source "image") }}true{{ end }}
{{- end }}

{{/* Volume mounts of a Ray container; `.root`, `.replicas` (runs model replicas). */}}
{{- define "mtpserve.volumeMounts" -}}
{{- $v := .root.Values -}}
- name: dshm
  mountPath: /dev/shm
{{- if include "mtpserve.hasModel" . }}
- name: model
  mountPath: {{ $v.model.mountPath }}
  readOnly: {{ or (ne $v.model.source "pvc") $v.model.pvc.readOnly }}
{{- end }}
{{- if ne $v.compileCache.type "none" }}
- name: compile-cache
  mountPath: {{ $v.compileCache.mountPath }}
{{- end }}
{{- with $v.extraVolumeMounts }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* Volumes of a Ray pod; `.root`, `.replicas`, `.shmMi` (the /dev/shm size). */}}
{{- define "mtpserve.volumes" -}}
{{- $v := .root.Values -}}
- name: dshm
  emptyDir:
    medium: Memory
    sizeLimit: {{ printf "%dMi" (int64 .shmMi) }}
{{- $m := $v.model }}
{{- if include "mtpserve.hasModel" . }}
{{- if or (eq $m.source "pvc") (and (eq $m.source "hf") (eq $m.hf.cache "pvc")) }}
- name: model
  persistentVolumeClaim:
    claimName: {{ include "mtpserve.modelClaimName" .root }}
{{- else if eq $m.source "hf" }}
- name: model
  emptyDir:
    sizeLimit: {{ $m.hf.emptyDirSizeLimit }}
{{- else if eq $m.source "hostPath" }}
- name: model
  hostPath:
    path: {{ $m.hostPath }}
    type: Directory
{{- end }}
{{- end }}
{{- with $v.compileCache }}
{{- if eq .type "emptyDir" }}
- name: compile-cache
  emptyDir:
    sizeLimit: {{ .sizeLimit }}
{{- else if eq .type "hostPath" }}
- name: compile-cache
  hostPath:
    path: {{ .hostPath }}
    type: DirectoryOrCreate
{{- else if eq .type "pvc" }}
- name: compile-cache
  persistentVolumeClaim:
    claimName: {{ required "compileCache.claimName is required with compileCache.type pvc" .claimName }}
{{- end }}
{{- end }}
{{- with $v.extraVolumes }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/*
Resources of a Ray container: the given ones, plus an ephemeral-storage request for a
per-pod hub download (the emptyDir lands on the node's disk, so the scheduler must see it).
*/}}
{{- define "mtpserve.containerResources" -}}
{{- $res := deepCopy (.resources | default dict) }}
{{- $m := .root.Values.model }}
{{- if and (include "mtpserve.hasModel" .) (eq $m.source "hf") (eq $m.hf.cache "emptyDir") }}
{{- $req := deepCopy (get $res "requests" | default dict) }}
{{- if not (hasKey $req "ephemeral-storage") }}
{{- $_ := set $req "ephemeral-storage" (toString ($m.hf.ephemeralStorageRequest | default $m.hf.emptyDirSizeLimit)) }}
{{- end }}
{{- $_ := set $res "requests" $req }}
{{- end }}
{{- toYaml $res }}
{{- end }}

{{/*
The hub download (source hf, pods that run replicas only) and the user's init containers.
Only the files the server reads are fetched (model.hf.allowPatterns: weights, configs,
tokenizer), not a repository's other formats (*.bin, *.pth, GGUF, ONNX, ...).
*/}}
{{- define "mtpserve.initContainers" -}}
{{- $v := .root.Values }}
{{- $m := $v.model }}
{{- if and (include "mtpserve.hasModel" .) (eq $m.source "hf") }}
- name: model-download
  image: {{ include "mtpserve.image" .root }}
  imagePullPolicy: {{ $v.image.pullPolicy }}
  # snapshot_download skips files already complete in the folder, so restarts and a shared PVC
  # cache download only what is missing.
  command:
    - python
    - -c
    - |
      import json, os
      from huggingface_hub import snapshot_download
      snapshot_download(repo_id=os.environ["MTPSERVE_HF_REPO"],
                        revision=os.environ["MTPSERVE_HF_REVISION"],
                        local_dir=os.environ["MTPSERVE_MODEL_DIR"],
                        allow_patterns=json.loads(os.environ["MTPSERVE_HF_ALLOW_PATTERNS"]))
  env:
    - name: MTPSERVE_HF_REPO
      value: {{ $m.hf.repo | quote }}
    - name: MTPSERVE_HF_REVISION
      value: {{ $m.hf.revision | quote }}
    - name: MTPSERVE_MODEL_DIR
      value: {{ (include "mtpserve.serveArgs" .root | fromYaml).model | quote }}
    - name: MTPSERVE_HF_ALLOW_PATTERNS
      value: {{ $m.hf.allowPatterns | toJson | quote }}
    - name: HF_HOME
      value: {{ printf "%s/.hf-home" ($m.mountPath | trimSuffix "/") | quote }}
    {{- with $m.hf.tokenSecret.name }}
    - name: HF_TOKEN
      valueFrom:
        secretKeyRef:
          name: {{ . }}
          key: {{ $m.hf.tokenSecret.key }}
    {{- end }}
  resources:
    {{- toYaml $m.hf.resources | nindent 4 }}
  securityContext:
    {{- toYaml $v.containerSecurityContext | nindent 4 }}
  volumeMounts:
    - name: model
      mountPath: {{ $m.mountPath }}
{{- end }}
{{- with $v.extraInitContainers }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* Pod labels and annotations; `.clusterSpec` ties the pod to its RayCluster's spec. */}}
{{- define "mtpserve.podMeta" -}}
labels:
  {{- include "mtpserve.selectorLabels" .root | nindent 2 }}
  app.kubernetes.io/component: {{ .component }}
  {{- with .clusterSpec }}
  mtpserve.io/cluster-spec: {{ . }}
  {{- end }}
  {{- with .root.Values.podLabels }}
  {{- toYaml . | nindent 2 }}
  {{- end }}
{{- with .root.Values.podAnnotations }}
annotations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{/*
Pod-level settings shared by all pod specs; `.spec` is head or a worker group, `.head` says
which, `.replicas` whether it runs model replicas. Only the head gets the service account and
its token (the autoscaler sidecar patches pods with it); workers run without any API
credentials.
*/}}
{{- define "mtpserve.podSpec" -}}
{{- $v := .root.Values }}
{{- if .head }}
{{- with include "mtpserve.headServiceAccountName" .root }}
serviceAccountName: {{ . }}
{{- end }}
automountServiceAccountToken: {{ $v.autoscaler.enabled }}
{{- else }}
automountServiceAccountToken: false
{{- with $v.runtimeClassName }}
runtimeClassName: {{ . }}
{{- end }}
{{- end }}
terminationGracePeriodSeconds: {{ include "mtpserve.gracePeriod" (dict "root" .root "head" .head) }}
{{- with $v.priorityClassName }}
priorityClassName: {{ . }}
{{- end }}
{{- with $v.podSecurityContext }}
securityContext:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $v.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .spec.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .spec.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .spec.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with include "mtpserve.initContainers" (dict "root" .root "replicas" .replicas) | trim }}
initContainers:
  {{- . | nindent 2 }}
{{- end }}
{{- end }}

{{/* Container securityContext; RDMA pinning needs IPC_LOCK on the GPU workers. */}}
{{- define "mtpserve.containerSecurityContext" -}}
{{- $sc := deepCopy (.root.Values.containerSecurityContext | default dict) }}
{{- if and .rdma .root.Values.rdma.resourceName .root.Values.rdma.ipcLock }}
{{- $caps := deepCopy ($sc.capabilities | default dict) }}
{{- $_ := set $caps "add" (concat ($caps.add | default list) (list "IPC_LOCK") | uniq) }}
{{- $_ := set $sc "capabilities" $caps }}
{{- end }}
{{- toYaml $sc }}
{{- end }}

{{/*
Replicas of one role a worker pod holds (by GPUs, and by CPUs where the pod's CPUs are known),
as an integer; 1000000 when neither bounds it.
*/}}
{{- define "mtpserve.replicasPerPod" -}}
{{- $group := get .root.Values.workers .role }}
{{- $side := get .root.Values.serve.args .role | default dict }}
{{- $tp := $side.tp_size | default 1 | float64 }}
{{- $needGpu := mulf $tp ($side.gpus_per_rank | default 0 | float64) }}
{{- $needCpu := mulf $tp ($side.cpus_per_rank | default 1 | float64) }}
{{- $podCpu := include "mtpserve.podCpus" $group | float64 }}
{{- $perPod := 1000000.0 }}
{{- if gt $needGpu 0.0 }}{{ $perPod = minf $perPod (floor (divf $group.gpusPerPod $needGpu)) }}{{ end }}
{{- if and (gt $needCpu 0.0) (ge $podCpu 0.0) }}{{ $perPod = minf $perPod (floor (divf $podCpu $needCpu)) }}{{ end }}
{{- $perPod | int64 }}
{{- end }}

{{/*
Custom Ray resources a worker pod of `.role` advertises for role pinning: each key of
serve.args.<role>.resources times the TP-rank bundles the pod holds (replicas per pod ×
tp_size), so the bundles of one role fit only on their own group's pods. JSON object, or "" when
pinning is off.
*/}}
{{- define "mtpserve.pinnedResources" -}}
{{- $v := .root.Values }}
{{- if $v.rolePinning.enabled }}
{{- $side := get $v.serve.args .role | default dict }}
{{- $bundles := mul (include "mtpserve.replicasPerPod" . | int64) ($side.tp_size | default 1 | int64) }}
{{- $out := dict }}
{{- range $k, $amount := ($side.resources | default dict) }}
{{- $_ := set $out $k (mulf $amount $bundles) }}
{{- end }}
{{- toJson $out }}
{{- end }}
{{- end }}

{{/*
`ray start` parameters of a worker group: the user's, the object store sized to /dev/shm, and
(role pinning) the custom resources as '{"name": N}': KubeRay passes `resources` to `ray start
--resources` verbatim (after trimming the quotes to read it, pod.go getResourcesMap), the shell
unquotes it, and the Ray autoscaler drops the outer quotes and parses the JSON, integers only
(ray/autoscaler/_private/kuberay/autoscaling_config.py `_get_custom_resources`).
*/}}
{{- define "mtpserve.workerStartParams" -}}
{{- $group := get .root.Values.workers .role }}
{{- $params := deepCopy ($group.rayStartParams | default dict) }}
{{- $mem := include "mtpserve.groupMemory" (dict "root" .root "resources" $group.resources "rayStartParams" $group.rayStartParams "where" (printf "workers.%s" .role)) | fromYaml }}
{{- $_ := set $params "object-store-memory" (toString $mem.objectStoreBytes) }}
{{- with include "mtpserve.pinnedResources" . }}
{{- $counts := dict }}
{{- range $k, $n := fromJson . }}
{{- $_ := set $counts $k (int64 $n) }}
{{- end }}
{{- $_ := set $params "resources" (printf "'%s'" (toJson $counts)) }}
{{- end }}
{{- toYaml $params }}
{{- end }}

{{/*
The worker preStop hook: drain this pod's Ray node through GCS (what `ray drain-node` and
Ray's autoscaler call; reason PREEMPTION, which GCS never rejects) with the drain deadline, wait
until the raylet has finished draining (it exits once the node is idle: Serve has started
replacement replicas elsewhere and stopped the ones here gracefully) or the deadline passes,
then `ray stop`. The node is found by its instance id (KubeRay sets RAY_CLOUD_INSTANCE_ID to
the pod name) or the pod IP. Best effort: any failure (GCS gone during a cluster deletion, say)
ends in `ray stop` at once. Its log lines go to the container's stdout (`kubectl logs`).
*/}}
{{- define "mtpserve.preStop" -}}
{{- $deadline := include "mtpserve.drainDeadline" .root | int -}}
timeout -k 2 {{ add $deadline 3 }} python - {{ $deadline }} <<'PY' || true
import os, sys, time

deadline_s = int(sys.argv[1])
end = time.monotonic() + deadline_s
try:
    out = open("/proc/1/fd/1", "w")
except OSError:
    out = sys.stdout


def say(msg):
    print(f"mtpserve preStop: {msg}", file=out, flush=True)


def raylet_running():
    for pid in os.listdir("/proc"):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"/raylet" in f.read().split(b"\0")[0]:
                    return True
        except (OSError, ValueError):
            pass
    return False


try:
    from ray._raylet import GcsClient
    from ray.core.generated import autoscaler_pb2, gcs_pb2

    gcs = GcsClient(address=os.environ["RAY_ADDRESS"])
    pod, ip = os.environ.get("RAY_CLOUD_INSTANCE_ID", ""), os.environ.get("MTPSERVE_POD_IP", "")

    def my_nodes():
        nodes = gcs.get_all_node_info(timeout=5).values()
        return [n.node_id.hex() for n in nodes if n.state == gcs_pb2.GcsNodeInfo.ALIVE
                and ((pod and n.instance_id == pod) or (ip and n.node_manager_address == ip))]

    mine = my_nodes()
    if not mine:
        say("no live Ray node on this pod; nothing to drain")
        sys.exit(0)
    accepted, why = gcs.drain_node(
        mine[0], autoscaler_pb2.DrainNodeReason.DRAIN_NODE_REASON_PREEMPTION,
        f"pod {pod or ip} is terminating", int(time.time() * 1000) + deadline_s * 1000,
        timeout=10)
    if not accepted:
        say(f"drain of node {mine[0]} refused: {why}")
        sys.exit(0)
    say(f"draining node {mine[0]} (deadline {deadline_s}s)")
    while time.monotonic() < end:
        time.sleep(2)
        if not raylet_running() or mine[0] not in my_nodes():
            say("node drained")
            break
    else:
        say("drain deadline reached")
except Exception as e:  # never block the pod's shutdown
    say(f"drain failed ({type(e).__name__}: {e}); stopping Ray now")
PY
ray stop -g {{ .root.Values.drain.stopSeconds }}
{{- end }}

{{/*
One worker group (prefill or decode). Its pods carry whole TP groups: a replica's placement
group needs tp_size × gpus_per_rank GPUs, and a pod with fewer could never host one.
*/}}
{{- define "mtpserve.workerGroup" -}}
{{- $root := .root }}
{{- $v := $root.Values }}
{{- $group := .group }}
{{- $resources := deepCopy ($group.resources | default dict) }}
{{- $extra := dict }}
{{- if gt (int $group.gpusPerPod) 0 }}
{{- /* gpusPerPod is the single source of the GPU count: it overrides resources.*[gpu]. */}}
{{- $_ := set $extra $v.gpuResourceName ($group.gpusPerPod | int | toString) }}
{{- end }}
{{- if $v.rdma.resourceName }}
{{- $_ := set $extra $v.rdma.resourceName ($v.rdma.perPod | int | toString) }}
{{- end }}
{{- range $kind := list "limits" "requests" }}
{{- if $extra }}
{{- $m := deepCopy (get $resources $kind | default dict) }}
{{- range $k, $val := $extra }}
{{- $_ := set $m $k $val }}
{{- end }}
{{- $_ := set $resources $kind $m }}
{{- end }}
{{- end }}
{{- $mem := include "mtpserve.groupMemory" (dict "root" $root "resources" $group.resources "rayStartParams" $group.rayStartParams "where" (printf "workers.%s" .role)) | fromYaml }}
{{- $pod := dict "root" $root "replicas" true "shmMi" $mem.shmMi }}
- groupName: {{ .role }}
  replicas: {{ $group.replicas | int }}
  minReplicas: {{ $group.minReplicas | int }}
  maxReplicas: {{ $group.maxReplicas | int }}
  rayStartParams:
    {{- include "mtpserve.workerStartParams" . | nindent 4 }}
  template:
    metadata:
      {{- include "mtpserve.podMeta" (dict "root" $root "component" .role "clusterSpec" .clusterSpec) | nindent 6 }}
    spec:
      {{- include "mtpserve.podSpec" (dict "root" $root "spec" $group "head" false "replicas" true) | trim | nindent 6 }}
      containers:
        - name: ray-worker
          image: {{ include "mtpserve.image" $root }}
          imagePullPolicy: {{ $v.image.pullPolicy }}
          ports:
            - name: serve
              containerPort: {{ include "mtpserve.httpPort" $root }}
            - name: metrics
              containerPort: 8080
          env:
            {{- include "mtpserve.env" $root | trim | nindent 12 }}
            {{- with $group.env }}
            {{- toYaml . | nindent 12 }}
            {{- end }}
          resources:
            {{- include "mtpserve.containerResources" (dict "root" $root "replicas" true "resources" $resources) | nindent 12 }}
          securityContext:
            {{- include "mtpserve.containerSecurityContext" (dict "root" $root "rdma" true) | nindent 12 }}
          volumeMounts:
            {{- include "mtpserve.volumeMounts" $pod | nindent 12 }}
          lifecycle:
            preStop:
              exec:
                command:
                  - /bin/sh
                  - -c
                  - |
                    {{- include "mtpserve.preStop" . | nindent 20 }}
      volumes:
        {{- include "mtpserve.volumes" $pod | nindent 8 }}
{{- end }}

{{/*
Labels of the `helm test` pod: the release and its component, but not the chart name, so the
NetworkPolicy's Ray-to-Ray rule (which selects name + instance) does not cover it.
*/}}
{{- define "mtpserve.helmTestLabels" -}}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: helm-test
{{- end }}

{{/*
Where `helm test` reaches the API: helmTest.url, else the serve Service, or with incremental
upgrades the Service of KubeRay's Gateway (<fullname>-gateway, port 80), named
<gateway>-<gateway class> as Gateway API GEP-1762 recommends for in-cluster implementations.
*/}}
{{- define "mtpserve.helmTestUrl" -}}
{{- if .Values.helmTest.url }}
{{- .Values.helmTest.url | trimSuffix "/" }}
{{- else if eq .Values.upgrade.strategy "NewClusterWithIncrementalUpgrade" }}
{{- printf "http://%s-gateway-%s.%s.svc:80" (include "mtpserve.fullname" .) .Values.upgrade.incremental.gatewayClassName .Release.Namespace }}
{{- else }}
{{- printf "http://%s.%s.svc:%d" (include "mtpserve.serveServiceName" .) .Release.Namespace (include "mtpserve.httpPort" . | int) }}
{{- end }}
{{- end }}

{{/*
Histogram bounds of /metrics (workers/replica/metrics.py TTFT_BUCKETS, ITL_BUCKETS), written as the
`le` labels router/metrics_api.py prints (Python's repr of a float); tests/test_helm_alerts.py
keeps them equal.
*/}}
{{- define "mtpserve.ttftBuckets" -}}
["0.001", "0.005", "0.01", "0.02", "0.04", "0.06", "0.08", "0.1", "0.25", "0.5", "0.75", "1.0", "2.5", "5.0", "7.5", "10.0", "20.0", "40.0", "80.0", "160.0", "640.0"]
{{- end }}
{{- define "mtpserve.itlBuckets" -}}
["0.001", "0.0025", "0.005", "0.01", "0.025", "0.05", "0.075", "0.1", "0.15", "0.2", "0.3", "0.4", "0.5", "0.75", "1.0", "2.5", "5.0", "7.5", "10.0", "20.0", "40.0", "80.0"]
{{- end }}

{{/* The first bound of `.bounds` (strings) at or above `.value`; "+Inf" when none is. */}}
{{- define "mtpserve.bucketAtOrAbove" -}}
{{- $pick := "" }}
{{- range .bounds }}
{{- if and (not $pick) (ge (float64 .) $.value) }}{{ $pick = . }}{{ end }}
{{- end }}
{{- $pick | default "+Inf" }}
{{- end }}
