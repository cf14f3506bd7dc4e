{{/* The head's `ray start` parameters. */}}
{{- define "mtpserve.headStartParams" -}}
{{- $params := deepCopy (.Values.head.rayStartParams | default dict) }}
{{- /* KubeRay reaches the dashboard through the head Service; the NetworkPolicy fences it. */}}
{{- $_ := set $params "dashboard-host" (get $params "dashboard-host" | default "0.0.0.0") }}
{{- if and .Values.head.noReplicas (not (hasKey $params "num-cpus")) }}
{{- /* No CPUs advertised on the head, so Serve places every replica on a worker pod. */}}
{{- $_ := set $params "num-cpus" "0" }}
{{- end }}
{{- $mem := include "mtpserve.groupMemory" (dict "root" . "resources" .Values.head.resources "rayStartParams" .Values.head.rayStartParams "where" "head") | fromYaml }}
{{- $_ := set $params "object-store-memory" (toString $mem.objectStoreBytes) }}
{{- toYaml $params }}
{{- end }}

{{/* "true" when the head may run replicas (it advertises CPUs): then it needs the model. */}}
{{- define "mtpserve.headRunsReplicas" -}}
{{- $params := include "mtpserve.headStartParams" . | fromYaml }}
{{- if or (not (hasKey $params "num-cpus")) (gt (include "mtpserve.cpuFloat" (get $params "num-cpus") | float64) 0.0) }}true{{ end }}
{{- end }}

{{/*
The RayService's `rayClusterConfig`; `.clusterSpec` (may be empty) labels every pod with the
hash of this spec (see mtpserve.clusterSpec).
*/}}
{{- define "mtpserve.rayClusterConfig" -}}
{{- $root := .root }}
{{- $v := $root.Values }}
{{- $headParams := include "mtpserve.headStartParams" $root | fromYaml }}
{{- $headMem := include "mtpserve.groupMemory" (dict "root" $root "resources" $v.head.resources "rayStartParams" $v.head.rayStartParams "where" "head") | fromYaml }}
{{- $headPod := dict "root" $root "replicas" (include "mtpserve.headRunsReplicas" $root) "shmMi" $headMem.shmMi }}
{{- $httpPort := include "mtpserve.httpPort" $root | int }}
rayVersion: {{ $v.rayVersion | quote }}
enableInTreeAutoscaling: {{ $v.autoscaler.enabled }}
{{- if $v.autoscaler.enabled }}
autoscalerOptions:
  idleTimeoutSeconds: {{ $v.autoscaler.idleTimeoutSeconds | int }}
  upscalingMode: {{ $v.autoscaler.upscalingMode }}
  {{- with $v.autoscaler.version }}
  version: {{ . }}
  {{- end }}
  resources:
    {{- toYaml $v.autoscaler.resources | nindent 4 }}
  securityContext:
    {{- toYaml $v.containerSecurityContext | nindent 4 }}
{{- end }}
authOptions:
  mode: {{ ternary "token" "disabled" $v.rayAuth.enabled }}
  {{- if and $v.rayAuth.enabled $v.rayAuth.secretName }}
  secretName: {{ $v.rayAuth.secretName }}
  {{- end }}
{{- with $v.gcsFaultTolerance }}
{{- if .enabled }}
# No externalStorageNamespace: KubeRay then keys each RayCluster's GCS state by its UID, so the
# old and new clusters of an upgrade never share (or clean up) each other's Redis keys.
gcsFaultToleranceOptions:
  redisAddress: {{ .redisAddress | quote }}
  {{- if .redisPasswordSecret.name }}
  redisPassword:
    valueFrom:
      secretKeyRef:
        name: {{ .redisPasswordSecret.name }}
        key: {{ .redisPasswordSecret.key }}
  {{- end }}
{{- end }}
{{- end }}
headGroupSpec:
  rayStartParams:
    {{- toYaml $headParams | nindent 4 }}
  template:
    metadata:
      {{- include "mtpserve.podMeta" (dict "root" $root "component" "head" "clusterSpec" .clusterSpec) | nindent 6 }}
    spec:
      {{- include "mtpserve.podSpec" (dict "root" $root "spec" $v.head "head" true "replicas" $headPod.replicas) | trim | nindent 6 }}
      containers:
        - name: ray-head
          image: {{ include "mtpserve.image" $root }}
          imagePullPolicy: {{ $v.image.pullPolicy }}
          ports:
            - name: gcs-server
              containerPort: 6379
            - name: dashboard
              containerPort: 8265
            - name: client
              containerPort: 10001
            - name: serve
              containerPort: {{ $httpPort }}
            - name: metrics
              containerPort: 8080
            # Metrics of the autoscaler sidecar and the dashboard (same pod network).
            - name: as-metrics
              containerPort: 44217
            - name: dash-metrics
              containerPort: 44227
          env:
            {{- include "mtpserve.env" $root | trim | nindent 12 }}
            {{- with $v.head.env }}
            {{- toYaml . | nindent 12 }}
            {{- end }}
          resources:
            {{- include "mtpserve.containerResources" (dict "root" $root "replicas" $headPod.replicas "resources" $v.head.resources) | nindent 12 }}
          securityContext:
            {{- include "mtpserve.containerSecurityContext" (dict "root" $root "rdma" false) | nindent 12 }}
          volumeMounts:
            {{- include "mtpserve.volumeMounts" $headPod | nindent 12 }}
      volumes:
        {{- include "mtpserve.volumes" $headPod | nindent 8 }}
workerGroupSpecs:
  {{- range $role := list "prefill" "decode" }}
  {{- $ctx := dict "root" $root "role" $role "group" (get $v.workers $role) "clusterSpec" $.clusterSpec }}
  {{- include "mtpserve.workerGroup" $ctx | trim | nindent 2 }}
  {{- end }}
{{- end }}

{{/*
Hash of the cluster spec, minus what KubeRay leaves out of its own (utils.
GenerateHashWithoutReplicasAndWorkersToDelete in v1.7: worker replica counts and bounds,
tolerations, scheduling gates). KubeRay builds a new RayCluster exactly when its hash changes,
so pods carrying this label belong to one cluster generation: the PodDisruptionBudgets select
it and never span the old and the new cluster of an upgrade, and changing only replica counts
or tolerations leaves it (and the running cluster) alone.
*/}}
{{- define "mtpserve.clusterSpec" -}}
{{- $spec := include "mtpserve.rayClusterConfig" (dict "root" . "clusterSpec" "") | fromYaml }}
{{- $_ := unset $spec.headGroupSpec.template.spec "tolerations" }}
{{- range $g := $spec.workerGroupSpecs }}
{{- $_ := unset $g "replicas" }}
{{- $_ := unset $g "minReplicas" }}
{{- $_ := unset $g "maxReplicas" }}
{{- $_ := unset $g.template.spec "tolerations" }}
{{- end }}
{{- toJson $spec | sha256sum | trunc 10 }}
{{- end }}
