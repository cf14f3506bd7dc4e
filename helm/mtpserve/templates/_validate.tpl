{{/*
Install-time validation: each `fail` below stands for a values set that renders into valid
Kubernetes objects but breaks only once the cluster runs (a replica that can never be placed, a
Serve app that fails to build, traffic cut during an upgrade). values.schema.json covers types
and unknown keys; these checks cover what crosses fields. tests/test_helm_validation.py has a
case for each.
*/}}

{{/* CPU quantity ("8", 8, "500m") as a float. */}}
{{- define "mtpserve.cpuFloat" -}}
{{- $q := toString . }}
{{- if hasSuffix "m" $q }}{{ divf (trimSuffix "m" $q | float64) 1000 }}{{ else }}{{ $q | float64 }}{{ end }}
{{- end }}

{{/* The CPUs Ray advertises on a worker pod: num-cpus, else the CPU limit, else the request. */}}
{{- define "mtpserve.podCpus" -}}
{{- $res := .resources | default dict }}
{{- $cpu := get (.rayStartParams | default dict) "num-cpus" }}
{{- if not $cpu }}{{ $cpu = get ($res.limits | default dict) "cpu" }}{{ end }}
{{- if not $cpu }}{{ $cpu = get ($res.requests | default dict) "cpu" }}{{ end }}
{{- if $cpu }}{{ include "mtpserve.cpuFloat" $cpu }}{{ else }}-1{{ end }}
{{- end }}

{{- define "mtpserve.validateRole" -}}
{{- $v := .root.Values }}
{{- $role := .role }}
{{- $group := get $v.workers $role }}
{{- $side := get $v.serve.args $role | default dict }}
{{- $tp := $side.tp_size | default 1 | int }}
{{- $gpr := $side.gpus_per_rank | default 0 | float64 }}
{{- $cpr := $side.cpus_per_rank | default 1 | float64 }}
{{- if gt (int $group.minReplicas) (int $group.maxReplicas) }}
{{- fail (printf "workers.%s.minReplicas exceeds maxReplicas" $role) }}
{{- end }}
{{- if or (lt (int $group.replicas) (int $group.minReplicas)) (gt (int $group.replicas) (int $group.maxReplicas)) }}
{{- fail (printf "workers.%s.replicas=%v is outside minReplicas..maxReplicas" $role $group.replicas) }}
{{- end }}
{{- if and (gt $tp 1) (gt $gpr 0.0) (ne $gpr (floor $gpr)) }}
{{- fail (printf "serve.args.%s.gpus_per_rank=%v is fractional with tp_size=%d: the TP ranks of one replica would share a GPU, which NCCL refuses" $role $gpr $tp) }}
{{- end }}
{{- $needGpu := mulf $tp $gpr }}
{{- if gt $needGpu (float64 $group.gpusPerPod) }}
{{- fail (printf "workers.%s.gpusPerPod=%v is below one replica's GPUs (tp_size × gpus_per_rank = %v)" $role $group.gpusPerPod $needGpu) }}
{{- end }}
{{- if and (eq $v.serve.args.device "cuda") (eq (int $group.gpusPerPod) 0) }}
{{- fail (printf "serve.args.device is cuda but workers.%s.gpusPerPod is 0" $role) }}
{{- end }}
{{- $needCpu := mulf $tp $cpr }}
{{- $podCpu := include "mtpserve.podCpus" $group | float64 }}
{{- if and (ge $podCpu 0.0) (gt $needCpu $podCpu) }}
{{- fail (printf "workers.%s pod CPU (%v) is below one replica's CPUs (tp_size × cpus_per_rank = %v)" $role $podCpu $needCpu) }}
{{- end }}
{{- /* Replicas one pod holds, by GPUs and by CPUs; times the pods the group may have. */}}
{{- $perPod := 1000000.0 }}
{{- if gt $needGpu 0.0 }}{{ $perPod = minf $perPod (floor (divf $group.gpusPerPod $needGpu)) }}{{ end }}
{{- if and (gt $needCpu 0.0) (ge $podCpu 0.0) }}{{ $perPod = minf $perPod (floor (divf $podCpu $needCpu)) }}{{ end }}
{{- $pods := ternary $group.maxReplicas $group.replicas $v.autoscaler.enabled | int }}
{{- $want := $side.replicas | default 1 | int }}
{{- $which := "replicas" }}
{{- if $side.autoscaling }}
{{- $want = $side.autoscaling.max_replicas | default 1 | int }}
{{- $which = "autoscaling.max_replicas" }}
{{- end }}
{{- if lt (mulf $pods $perPod) (float64 $want) }}
{{- fail (printf "serve.args.%s.%s=%d exceeds what workers.%s can hold: %d pods × %v replicas per pod (raise workers.%s.%s)" $role $which $want $role $pods $perPod $role (ternary "maxReplicas" "replicas" $v.autoscaler.enabled)) }}
{{- end }}
{{- end }}

{{- define "mtpserve.validate" -}}
{{- $v := .Values }}
{{- $args := $v.serve.args }}
{{- $kv := $args.kv_transfer | default dict }}
{{- $http := $args.http | default dict }}
{{- $port := include "mtpserve.httpPort" . | int }}

{{- /* Serve app build (ClusterConfig) failures. */}}
{{- if and (eq ($kv.backend | default "gloo") "nccl") (ne ($args.device | default "cpu") "cuda") }}
{{- fail "serve.args.kv_transfer.backend nccl needs serve.args.device cuda (use gloo on CPU)" }}
{{- end }}
{{- range $role := list "prefill" "decode" }}
{{- include "mtpserve.validateRole" (dict "root" $ "role" $role) }}
{{- end }}

{{- /* Overrides that replace, not merge, what the builder computed. */}}
{{- range $dep := $v.serve.deployments }}
{{- range $key := list "ray_actor_options" "graceful_shutdown_timeout_s" "placement_group_bundles" "placement_group_strategy" "placement_group_bundle_label_selector" "autoscaling_config" "num_replicas" "max_replicas_per_node" }}
{{- if hasKey $dep $key }}
{{- fail (printf "serve.deployments[%s].%s would replace the builder's %s (Serve overrides do not merge); set resources, replicas and autoscaling in serve.args, pinning in rolePinning" $dep.name $key $key) }}
{{- end }}
{{- end }}
{{- end }}

{{- /* HTTP: the proxies must be reachable on a port no Ray component uses. */}}
{{- if not (has ($http.host | default "127.0.0.1") (list "0.0.0.0" "::")) }}
{{- fail (printf "serve.args.http.host=%v binds the API to the pod itself; use 0.0.0.0 so the serve Service reaches it" ($http.host | default "127.0.0.1")) }}
{{- end }}
{{- if has $port (list 6379 8080 8265 10001 44217 44227 52365) }}
{{- fail (printf "serve.args.http.port=%d collides with a Ray port (6379, 8080, 8265, 10001, 44217, 44227, 52365)" $port) }}
{{- end }}
{{- /* Container ports, the NetworkPolicy and the PodMonitor are wired to Ray's default ports. */}}
{{- range $where, $params := dict "head" $v.head.rayStartParams "prefill" $v.workers.prefill.rayStartParams "decode" $v.workers.decode.rayStartParams }}
{{- range $key := list "port" "dashboard-port" "metrics-export-port" "ray-client-server-port" }}
{{- if hasKey ($params | default dict) $key }}
{{- fail (printf "%s.rayStartParams.%s: the chart's container ports, NetworkPolicy and PodMonitor use Ray's default ports; remove it" (ternary "head" (printf "workers.%s" $where) (eq $where "head")) $key) }}
{{- end }}
{{- end }}
{{- end }}
{{- if eq $v.serve.proxyLocation "Disabled" }}
{{- fail "serve.proxyLocation Disabled leaves the serve Service without any pod; use EveryNode or HeadOnly" }}
{{- end }}
{{- if and $v.serveService.excludeHeadPod (eq $v.serve.proxyLocation "HeadOnly") }}
{{- fail "serveService.excludeHeadPod with serve.proxyLocation HeadOnly leaves the serve Service without any pod" }}
{{- end }}

{{- /* Upgrades and shutdown: no request cut short. */}}
{{- $timeout := $args.request_timeout_s | default 600 | float64 }}
{{- if lt (include "mtpserve.deletionDelay" . | float64) $timeout }}
{{- fail (printf "upgrade.rayClusterDeletionDelaySeconds=%v is below serve.args.request_timeout_s=%v: the old cluster would be deleted under running requests" $v.upgrade.rayClusterDeletionDelaySeconds $timeout) }}
{{- end }}
{{- $drain := $args.graceful_shutdown_timeout_s | default 30 | float64 }}
{{- if lt (include "mtpserve.gracePeriod" . | float64) $drain }}
{{- fail (printf "terminationGracePeriodSeconds=%v is below serve.args.graceful_shutdown_timeout_s=%v: pods would be killed mid-drain" $v.terminationGracePeriodSeconds $drain) }}
{{- end }}
{{- if eq $v.upgrade.strategy "NewClusterWithIncrementalUpgrade" }}
{{- if not $v.upgrade.incremental.gatewayClassName }}
{{- fail "upgrade.strategy NewClusterWithIncrementalUpgrade needs upgrade.incremental.gatewayClassName (KubeRay splits traffic through a Gateway)" }}
{{- end }}
{{- if not $v.autoscaler.enabled }}
{{- fail "upgrade.strategy NewClusterWithIncrementalUpgrade needs autoscaler.enabled (capacity moves by scaling both clusters)" }}
{{- end }}
{{- if or (ne $v.serveService.type "ClusterIP") $v.serveService.annotations }}
{{- fail "serveService.type/annotations with NewClusterWithIncrementalUpgrade: KubeRay then ignores spec.serveService and routes through its Gateway; expose the Gateway instead" }}
{{- end }}
{{- if $v.httpRoute.enabled }}
{{- fail "httpRoute.enabled with NewClusterWithIncrementalUpgrade: KubeRay creates the Gateway route itself; a second route would bypass the traffic split" }}
{{- end }}
{{- end }}

{{- /* Model delivery. */}}
{{- $m := $v.model }}
{{- $mount := printf "%s/" ($m.mountPath | trimSuffix "/") }}
{{- if eq $m.source "pvc" }}
{{- if and (not $m.pvc.claimName) (not $m.pvc.create) }}
{{- fail "model.source is pvc but model.pvc.claimName is empty (or set model.pvc.create)" }}
{{- end }}
{{- else if eq $m.source "hostPath" }}
{{- if not $m.hostPath }}
{{- fail "model.source is hostPath but model.hostPath is empty" }}
{{- end }}
{{- else if eq $m.source "hf" }}
{{- if not $m.hf.repo }}
{{- fail "model.source is hf but model.hf.repo is empty" }}
{{- end }}
{{- if eq $m.hf.cache "pvc" }}
{{- if and (not $m.pvc.claimName) (not $m.pvc.create) }}
{{- fail "model.hf.cache is pvc but model.pvc.claimName is empty (or set model.pvc.create)" }}
{{- end }}
{{- if and $m.pvc.create (has "ReadOnlyMany" $m.pvc.accessModes) (not (has "ReadWriteMany" $m.pvc.accessModes)) }}
{{- fail "model.hf.cache is pvc but model.pvc.accessModes is ReadOnlyMany: the download cannot write" }}
{{- end }}
{{- end }}
{{- end }}
{{- if and (ne $m.source "image") $args.model (not (hasPrefix $mount (printf "%s" $args.model))) }}
{{- fail (printf "serve.args.model=%s is outside the model volume mounted at %s" $args.model $m.mountPath) }}
{{- end }}
{{- if and (eq $m.source "image") $args.model (hasPrefix $mount (printf "%s" $args.model)) }}
{{- fail (printf "serve.args.model=%s is below model.mountPath but model.source is image (nothing is mounted there)" $args.model) }}
{{- end }}

{{- /* Production knobs. */}}
{{- if and $v.gcsFaultTolerance.enabled (not $v.gcsFaultTolerance.redisAddress) }}
{{- fail "gcsFaultTolerance.enabled needs gcsFaultTolerance.redisAddress" }}
{{- end }}
{{- if and $v.rolePinning.enabled $v.autoscaler.enabled (ne $v.autoscaler.version "v2") }}
{{- fail "rolePinning with the autoscaler needs autoscaler.version v2 (v1 ignores label selectors and never adds the pinned pods)" }}
{{- end }}
{{- if and $v.ingress.enabled $v.httpRoute.enabled }}
{{- fail "ingress.enabled and httpRoute.enabled: pick one entry point" }}
{{- end }}
{{- end }}
