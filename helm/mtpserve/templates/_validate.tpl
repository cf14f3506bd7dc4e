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

{{/*
Role pinning: what each role's bundles ask (serve.args.<role>.resources) must be offered by its
own worker group only, in whole numbers (the Ray autoscaler reads integers).
*/}}
{{- define "mtpserve.validatePinning" -}}
{{- $v := .Values }}
{{- range $role := list "prefill" "decode" }}
{{- $other := ternary "decode" "prefill" (eq $role "prefill") }}
{{- $side := get $v.serve.args $role | default dict }}
{{- $want := $side.resources | default dict }}
{{- $group := get $v.workers $role }}
{{- $params := $group.rayStartParams | default dict }}
{{- if $v.rolePinning.enabled }}
{{- if not $want }}
{{- fail (printf "rolePinning.enabled but serve.args.%s.resources is empty: %s bundles could land on %s pods (e.g. {mtpserve-%s: 1})" $role $role $other $role) }}
{{- end }}
{{- if hasKey $params "resources" }}
{{- fail (printf "workers.%s.rayStartParams.resources: with rolePinning the chart sets it from serve.args.%s.resources" $role $role) }}
{{- end }}
{{- range $k, $amount := $want }}
{{- if hasKey ((get $v.serve.args $other | default dict).resources | default dict) $k }}
{{- fail (printf "serve.args.prefill.resources and serve.args.decode.resources both ask for %q: role pinning needs a resource per role" $k) }}
{{- end }}
{{- if le (float64 $amount) 0.0 }}
{{- fail (printf "serve.args.%s.resources.%s=%v: role pinning needs a positive amount" $role $k $amount) }}
{{- end }}
{{- end }}
{{- range $k, $n := include "mtpserve.pinnedResources" (dict "root" $ "role" $role) | fromJson }}
{{- if ne (float64 $n) (floor (float64 $n)) }}
{{- fail (printf "workers.%s pods would advertise %s=%v (serve.args.%s.resources.%s × TP-rank bundles per pod): the Ray autoscaler reads whole numbers only" $role $k $n $role $k) }}
{{- end }}
{{- end }}
{{- else }}
{{- range $k, $amount := $want }}
{{- if not (contains (printf "\"%s\"" $k) (get $params "resources" | default "" | replace "\\" "")) }}
{{- fail (printf "serve.args.%s.resources asks for %q, which no worker group offers (rolePinning is off and workers.%s.rayStartParams.resources lacks it): the replicas would never be placed" $role $k $role) }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}

{{/*
The ingress replicas (serve.args.ingress) take CPUs next to the prefill and decode replicas on
the worker pods (and on the head when it advertises CPUs): at their most they must fit in what
those pods have left over.
*/}}
{{- define "mtpserve.validateIngress" -}}
{{- $v := .Values }}
{{- $ing := $v.serve.args.ingress | default dict }}
{{- $cpus := $ing.cpus | default 0.25 | float64 }}
{{- $n := $ing.replicas | default 1 | int }}
{{- with $ing.autoscaling }}{{ $n = .max_replicas | default 4 | int }}{{ end }}
{{- $spare := 0.0 }}
{{- $unknown := false }}
{{- range $role := list "prefill" "decode" }}
{{- $group := get $v.workers $role }}
{{- $side := get $v.serve.args $role | default dict }}
{{- $podCpu := include "mtpserve.podCpus" $group | float64 }}
{{- if lt $podCpu 0.0 }}{{ $unknown = true }}{{ end }}
{{- $perPod := include "mtpserve.replicasPerPod" (dict "root" $ "role" $role) | float64 }}
{{- $pods := ternary $group.maxReplicas $group.replicas $v.autoscaler.enabled | float64 }}
{{- $want := $side.replicas | default 1 | float64 }}
{{- with $side.autoscaling }}{{ $want = .max_replicas | default 1 | float64 }}{{ end }}
{{- $used := mulf (minf (mulf $pods $perPod) $want) ($side.tp_size | default 1) ($side.cpus_per_rank | default 1) }}
{{- $spare = addf $spare (maxf 0.0 (subf (mulf $pods $podCpu) $used)) }}
{{- end }}
{{- if and (not $unknown) (not (include "mtpserve.headRunsReplicas" .)) (gt (mulf $n $cpus) $spare) }}
{{- fail (printf "serve.args.ingress: %d replicas × %v CPUs exceed the %v CPUs the worker pods have left next to the prefill and decode replicas; lower ingress.cpus or the replica count, or give the pods more CPUs" $n $cpus $spare) }}
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
{{- include "mtpserve.validateIngress" . }}

{{- /* Overrides that replace, not merge, what the builder computed (cluster/app.py
deployment_options, ingress_options): each has a knob in serve.args instead. */}}
{{- $roles := dict "OpenAIIngress" "ingress" "PrefillServer" "prefill" "DecodeServer" "decode" }}
{{- range $dep := $v.serve.deployments }}
{{- $role := get $roles $dep.name }}
{{- $fix := dict
  "num_replicas" (printf "serve.args.%s.replicas / serve.args.%s.autoscaling" $role $role)
  "autoscaling_config" (printf "serve.args.%s.autoscaling" $role)
  "ray_actor_options" (ternary "serve.args.ingress.cpus" (printf "serve.args.%s.cpus_per_rank / gpus_per_rank / resources" $role) (eq $role "ingress"))
  "placement_group_bundles" (printf "serve.args.%s (the builder makes one bundle per TP rank)" $role)
  "placement_group_strategy" (printf "serve.args.%s (the builder packs a replica's TP ranks)" $role)
  "placement_group_bundle_label_selector" "rolePinning (custom resources)"
  "graceful_shutdown_timeout_s" "serve.args.graceful_shutdown_timeout_s"
  "max_ongoing_requests" (get (dict "ingress" "serve.args.limits.max_concurrent_requests (Serve's cap sits 64 above it)" "decode" "serve.args.decode.max_num_seqs" "prefill" "serve.args.prefill.max_num_batched_tokens") $role)
  "max_queued_requests" "serve.args.limits.max_queued_requests" }}
{{- if ne $role "ingress" }}
{{- $_ := set $fix "request_router_config" "nothing: the builder's load-aware router (router/routing.py) must stay" }}
{{- $_ := set $fix "max_replicas_per_node" "nothing: Serve refuses it next to placement group bundles" }}
{{- end }}
{{- range $key := keys $fix | sortAlpha }}
{{- if hasKey $dep $key }}
{{- fail (printf "serve.deployments[%s].%s would replace the builder's %s (Serve overrides do not merge); set %s" $dep.name $key $key (get $fix $key)) }}
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
{{- if lt (include "mtpserve.gracePeriod" (dict "root" . "head" true) | float64) $drain }}
{{- fail (printf "terminationGracePeriodSeconds=%v is below serve.args.graceful_shutdown_timeout_s=%v: pods would be killed mid-drain" $v.terminationGracePeriodSeconds $drain) }}
{{- end }}
{{- $deadline := include "mtpserve.drainDeadline" . | float64 }}
{{- if lt $deadline $drain }}
{{- fail (printf "the worker drain deadline (%v s: drain.deadlineSeconds, or what terminationGracePeriodSeconds leaves after drain.stopSeconds + 10) is below serve.args.graceful_shutdown_timeout_s=%v: Serve would stop the replicas of a drained pod without their graceful shutdown" $deadline $drain) }}
{{- end }}
{{- $workerGrace := include "mtpserve.gracePeriod" (dict "root" . "head" false) | float64 }}
{{- if lt $workerGrace (addf $deadline $v.drain.stopSeconds 10) }}
{{- fail (printf "terminationGracePeriodSeconds=%v does not cover the worker preStop: drain.deadlineSeconds=%v + drain.stopSeconds=%v + 10" $v.terminationGracePeriodSeconds $deadline $v.drain.stopSeconds) }}
{{- end }}
{{- if eq $v.upgrade.strategy "NewClusterWithIncrementalUpgrade" }}
{{- if not $v.upgrade.incremental.featureGateEnabled }}
{{- fail "upgrade.strategy NewClusterWithIncrementalUpgrade needs the KubeRay operator's RayServiceIncrementalUpgrade feature gate (Beta and on by default in KubeRay v1.7; Alpha and off in v1.5-v1.6): without it KubeRay treats this strategy as \"no upgrades\" and pod-template changes never roll out. Check the operator (--feature-gates, or featureGates in its chart) and set upgrade.incremental.featureGateEnabled=true, or use NewCluster" }}
{{- end }}
{{- if gt (int $v.upgrade.incremental.stepSizePercent) (int $v.upgrade.incremental.maxSurgePercent) }}
{{- fail "upgrade.incremental.stepSizePercent exceeds maxSurgePercent: KubeRay rejects the RayService" }}
{{- end }}
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
{{- if $v.ingress.enabled }}
{{- fail (printf "ingress.enabled with NewClusterWithIncrementalUpgrade: the Ingress would point at %s, which KubeRay does not create in this mode (traffic enters through its Gateway %s-gateway); expose the Gateway instead" (include "mtpserve.serveServiceName" .) (include "mtpserve.fullname" .)) }}
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
{{- if $v.gcsFaultTolerance.externalStorageNamespace }}
{{- fail "gcsFaultTolerance.externalStorageNamespace: a fixed Redis namespace makes the old and new RayCluster of an upgrade share one GCS keyspace (and the old cluster's cleanup deletes the new one's state); leave it empty so KubeRay uses each cluster's UID" }}
{{- end }}
{{- with $v.rayService.annotations }}
{{- if hasKey . "ray.io/external-storage-namespace" }}
{{- fail "rayService.annotations[ray.io/external-storage-namespace]: KubeRay copies it to every RayCluster, so old and new clusters would share one GCS keyspace in Redis; remove it" }}
{{- end }}
{{- $t := get . "ray.io/initializing-timeout" | default "" | toString }}
{{- if and $t (not (regexMatch "^([0-9]+(\\.[0-9]+)?(ns|us|µs|ms|s|m|h))+$" $t)) (not (regexMatch "^[1-9][0-9]*$" $t)) }}
{{- fail (printf "rayService.annotations[ray.io/initializing-timeout]=%q: KubeRay wants a Go duration (30m, 1h) or whole seconds" $t) }}
{{- end }}
{{- end }}
{{- include "mtpserve.validatePinning" . }}
{{- if and $v.networkPolicy.enabled $v.networkPolicy.egress $v.autoscaler.enabled (not $v.networkPolicy.apiServer.peers) }}
{{- fail "networkPolicy.egress restricts egress but networkPolicy.apiServer.peers is empty: the head's autoscaler sidecar could not reach the Kubernetes API server; add its endpoints (e.g. [{ipBlock: {cidr: 10.0.0.1/32}}])" }}
{{- end }}
{{- if and $v.monitoring.prometheusRule.enabled (not $v.monitoring.podMonitor.enabled) }}
{{- fail "monitoring.prometheusRule needs monitoring.podMonitor: its rules select the labels (namespace, ray_cluster) that the PodMonitor's scrape adds" }}
{{- end }}
{{- if and $v.ingress.enabled $v.httpRoute.enabled }}
{{- fail "ingress.enabled and httpRoute.enabled: pick one entry point" }}
{{- end }}
{{- end }}
