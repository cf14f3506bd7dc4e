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

{{- define "mtpserve.httpPort" -}}
{{- (.Values.serve.args.http | default dict).port | default 8000 | int }}
{{- end }}

{{/*
The application's `args:`: serve.args plus what the chart itself wires (the API key env var).
A plaintext `auth.api_key` would end up in the RayService object, so it is refused here.
*/}}
{{- define "mtpserve.serveArgs" -}}
{{- $args := deepCopy .Values.serve.args }}
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

{{/* The Serve deploy config (ServeDeploySchema) that KubeRay PUTs to the dashboard. */}}
{{- define "mtpserve.serveConfig" -}}
{{- $app := dict "name" "mtpserve" "route_prefix" "/" "import_path" "cluster.app:build_app" }}
{{- $_ := set $app "args" (include "mtpserve.serveArgs" . | fromYaml) }}
{{- with .Values.serve.deployments }}
{{- $_ := set $app "deployments" . }}
{{- end }}
{{- $http := dict "host" "0.0.0.0" "port" (include "mtpserve.httpPort" . | int) }}
{{- $cfg := dict "proxy_location" .Values.serve.proxyLocation "http_options" $http }}
{{- $_ := set $cfg "applications" (list $app) }}
{{- toYaml $cfg }}
{{- end }}

{{/* Environment shared by every Ray container. */}}
{{- define "mtpserve.env" -}}
{{- /* KV senders must listen on an address decode pods on other nodes can reach. */}}
- name: MTPSERVE_KV_HOST
  valueFrom:
    fieldRef:
      fieldPath: status.podIP
- name: GLOO_SOCKET_IFNAME  # the pod network (KV channels and TP groups over gloo)
  value: eth0
{{- if .Values.auth.enabled }}
- name: {{ .Values.auth.envName }}
  valueFrom:
    secretKeyRef:
      name: {{ include "mtpserve.authSecretName" . }}
      key: {{ .Values.auth.secretKey }}
{{- end }}
{{- end }}

{{- define "mtpserve.volumeMounts" -}}
- name: dshm
  mountPath: /dev/shm
{{- if ne .Values.model.volume.type "none" }}
- name: model
  mountPath: {{ .Values.model.volume.mountPath }}
  readOnly: {{ .Values.model.volume.readOnly }}
{{- end }}
{{- end }}

{{- define "mtpserve.volumes" -}}
- name: dshm
  emptyDir:
    medium: Memory
    sizeLimit: {{ .Values.sharedMemory.sizeLimit }}
{{- $v := .Values.model.volume }}
{{- if eq $v.type "pvc" }}
{{- if not $v.claimName }}
{{- fail "model.volume.type is pvc but model.volume.claimName is empty" }}
{{- end }}
- name: model
  persistentVolumeClaim:
    claimName: {{ $v.claimName }}
    readOnly: {{ $v.readOnly }}
{{- else if eq $v.type "hostPath" }}
{{- if not $v.hostPath }}
{{- fail "model.volume.type is hostPath but model.volume.hostPath is empty" }}
{{- end }}
- name: model
  hostPath:
    path: {{ $v.hostPath }}
    type: Directory
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

{{/* Scheduling and pull settings shared by all pod specs; `.spec` is head or a worker group. */}}
{{- define "mtpserve.podScheduling" -}}
{{- with .root.Values.serviceAccountName }}
serviceAccountName: {{ . }}
{{- end }}
{{- with .root.Values.imagePullSecrets }}
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
{{- end }}

{{/*
One worker group (prefill or decode). Its pods carry whole TP groups: a replica's placement
group needs tp_size × gpus_per_rank GPUs, and a pod with fewer could never host one.
*/}}
{{- define "mtpserve.workerGroup" -}}
{{- $root := .root }}
{{- $group := .group }}
{{- $roleArgs := .roleArgs | default dict }}
{{- $need := mulf ($roleArgs.tp_size | default 1) ($roleArgs.gpus_per_rank | default 0) }}
{{- if gt $need (float64 $group.gpusPerPod) }}
{{- fail (printf "workers.%s.gpusPerPod=%v is below one replica's GPUs (tp_size × gpus_per_rank = %v)" .role $group.gpusPerPod $need) }}
{{- end }}
{{- if gt (int $group.minReplicas) (int $group.maxReplicas) }}
{{- fail (printf "workers.%s.minReplicas exceeds maxReplicas" .role) }}
{{- end }}
{{- $resources := deepCopy ($group.resources | default dict) }}
{{- if gt (int $group.gpusPerPod) 0 }}
{{- /* gpusPerPod is the single source of the GPU count: it overrides resources.*[gpu]. */}}
{{- range $kind := list "limits" "requests" }}
{{- $m := deepCopy (get $resources $kind | default dict) }}
{{- $_ := set $m $root.Values.gpuResourceName ($group.gpusPerPod | int | toString) }}
{{- $_ := set $resources $kind $m }}
{{- end }}
{{- end }}
- groupName: {{ .role }}
  replicas: {{ $group.replicas | int }}
  minReplicas: {{ $group.minReplicas | int }}
  maxReplicas: {{ $group.maxReplicas | int }}
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
      {{- with include "mtpserve.podScheduling" (dict "root" $root "spec" $group) | trim }}
      {{- . | nindent 6 }}
      {{- end }}
      containers:
        - name: ray-worker
          image: {{ include "mtpserve.image" $root }}
          imagePullPolicy: {{ $root.Values.image.pullPolicy }}
          ports:
            - name: metrics
              containerPort: 8080
          {{- $env := include "mtpserve.env" $root }}
          {{- if or $env $group.env }}
          env:
            {{- with $env }}
            {{- . | trim | nindent 12 }}
            {{- end }}
            {{- with $group.env }}
            {{- toYaml . | nindent 12 }}
            {{- end }}
          {{- end }}
          resources:
            {{- toYaml $resources | nindent 12 }}
          volumeMounts:
            {{- include "mtpserve.volumeMounts" $root | nindent 12 }}
          lifecycle:
            preStop:
              exec:
                command: ["/bin/sh", "-c", "ray stop"]
      volumes:
        {{- include "mtpserve.volumes" $root | nindent 8 }}
{{- end }}
