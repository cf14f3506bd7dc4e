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

{{/* Pod grace period: Serve's drain (graceful_shutdown_timeout_s) plus time for `ray stop`. */}}
{{- define "mtpserve.gracePeriod" -}}
{{- $g := .Values.terminationGracePeriodSeconds }}
{{- if kindIs "invalid" $g }}
{{- /* 30 s: ClusterConfig's default drain. */}}
{{- $drain := .Values.serve.args.graceful_shutdown_timeout_s | default 30 }}
{{- add (ceil $drain) 30 }}
{{- else }}
{{- $g | int }}
{{- end }}
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
Deployment overrides: the user's, plus the role pinning of PrefillServer/DecodeServer. Serve
accepts a bundle label selector only next to the bundles, so the chart repeats the builder's
bundles (cluster/app.py `_bundles`; tests/test_helm_chart.py keeps the two equal).
*/}}
{{- define "mtpserve.deployments" -}}
{{- $out := list }}
{{- $byName := dict }}
{{- range .Values.serve.deployments }}
{{- $_ := set $byName .name (deepCopy .) }}
{{- end }}
{{- if .Values.rolePinning.enabled }}
{{- range $role, $dep := dict "prefill" "PrefillServer" "decode" "DecodeServer" }}
{{- $side := get $.Values.serve.args $role | default dict }}
{{- $bundle := dict "CPU" ($side.cpus_per_rank | default 1) }}
{{- if $side.gpus_per_rank }}
{{- $_ := set $bundle "GPU" $side.gpus_per_rank }}
{{- end }}
{{- $bundles := list }}
{{- range until (int ($side.tp_size | default 1)) }}
{{- $bundles = append $bundles $bundle }}
{{- end }}
{{- $entry := get $byName $dep | default (dict "name" $dep) }}
{{- $_ := set $entry "placement_group_bundles" $bundles }}
{{- $_ := set $entry "placement_group_strategy" "STRICT_PACK" }}
{{- $_ := set $entry "placement_group_bundle_label_selector" (list (dict $.Values.rolePinning.labelKey $role)) }}
{{- $_ := set $byName $dep $entry }}
{{- end }}
{{- end }}
{{- /* Keep the user's order, then the chart-added entries in a fixed order. */}}
{{- $seen := dict }}
{{- range .Values.serve.deployments }}
{{- $out = append $out (get $byName .name) }}
{{- $_ := set $seen .name true }}
{{- end }}
{{- range $name := list "OpenAIIngress" "PrefillServer" "DecodeServer" }}
{{- if and (hasKey $byName $name) (not (hasKey $seen $name)) }}
{{- $out = append $out (get $byName $name) }}
{{- end }}
{{- end }}
{{- toYaml $out }}
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
{{- with .Values.network.env }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{- define "mtpserve.volumeMounts" -}}
- name: dshm
  mountPath: /dev/shm
{{- if ne .Values.model.source "image" }}
- name: model
  mountPath: {{ .Values.model.mountPath }}
  readOnly: {{ or (ne .Values.model.source "pvc") .Values.model.pvc.readOnly }}
{{- end }}
{{- with .Values.extraVolumeMounts }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{- define "mtpserve.volumes" -}}
- name: dshm
  emptyDir:
    medium: Memory
    sizeLimit: {{ .Values.sharedMemory.sizeLimit }}
{{- $m := .Values.model }}
{{- if or (eq $m.source "pvc") (and (eq $m.source "hf") (eq $m.hf.cache "pvc")) }}
- name: model
  persistentVolumeClaim:
    claimName: {{ include "mtpserve.modelClaimName" . }}
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
{{- with .Values.extraVolumes }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* The hub download (source hf) and the user's init containers. */}}
{{- define "mtpserve.initContainers" -}}
{{- $m := .Values.model }}
{{- if eq $m.source "hf" }}
- name: model-download
  image: {{ include "mtpserve.image" . }}
  imagePullPolicy: {{ .Values.image.pullPolicy }}
  # snapshot_download skips files already complete in the folder, so restarts and a shared PVC
  # cache download only what is missing.
  command:
    - python
    - -c
    - |
      import os
      from huggingface_hub import snapshot_download
      snapshot_download(repo_id=os.environ["MTPSERVE_HF_REPO"],
                        revision=os.environ["MTPSERVE_HF_REVISION"],
                        local_dir=os.environ["MTPSERVE_MODEL_DIR"])
  env:
    - name: MTPSERVE_HF_REPO
      value: {{ $m.hf.repo | quote }}
    - name: MTPSERVE_HF_REVISION
      value: {{ $m.hf.revision | quote }}
    - name: MTPSERVE_MODEL_DIR
      value: {{ (include "mtpserve.serveArgs" . | fromYaml).model | quote }}
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
    {{- toYaml .Values.containerSecurityContext | nindent 4 }}
  volumeMounts:
    - name: model
      mountPath: {{ $m.mountPath }}
{{- end }}
{{- with .Values.extraInitContainers }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{- define "mtpserve.podMeta" -}}
labels:
  {{- include "mtpserve.selectorLabels" .root | nindent 2 }}
  app.kubernetes.io/component: {{ .component }}
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
which. Only the head gets the service account and its token (the autoscaler sidecar patches
pods with it); workers run without any API credentials.
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
terminationGracePeriodSeconds: {{ include "mtpserve.gracePeriod" .root }}
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
{{- with include "mtpserve.initContainers" .root | trim }}
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
- groupName: {{ .role }}
  replicas: {{ $group.replicas | int }}
  minReplicas: {{ $group.minReplicas | int }}
  maxReplicas: {{ $group.maxReplicas | int }}
  {{- if $v.rolePinning.enabled }}
  # Ray node labels: the deployments' bundle label selectors pin each role to its group.
  labels:
    {{ $v.rolePinning.labelKey }}: {{ .role }}
  {{- end }}
  {{- with $group.rayStartParams }}
  rayStartParams:
    {{- toYaml . | nindent 4 }}
  {{- else }}
  rayStartParams: {}
  {{- end }}
  template:
    metadata:
      {{- include "mtpserve.podMeta" (dict "root" $root "component" .role) | nindent 6 }}
    spec:
      {{- include "mtpserve.podSpec" (dict "root" $root "spec" $group "head" false) | trim | nindent 6 }}
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
            {{- toYaml $resources | nindent 12 }}
          securityContext:
            {{- include "mtpserve.containerSecurityContext" (dict "root" $root "rdma" true) | nindent 12 }}
          volumeMounts:
            {{- include "mtpserve.volumeMounts" $root | nindent 12 }}
          lifecycle:
            preStop:
              exec:
                command: ["/bin/sh", "-c", "ray stop"]
      volumes:
        {{- include "mtpserve.volumes" $root | nindent 8 }}
{{- end }}
