#!/usr/bin/env bash
# Raw mpi4py Allreduce of 2 ranks (benchmarks.allreduce's raw half) in containers of the image
# (`make image`), as root: one rank in each of two containers on an internal podman network
# (MPICH on libfabric's tcp provider over their own eth0, as between pods), then both ranks in
# one container with the same settings on loopback. Prints one JSON line each:
# {bytes: best seconds, "hosts": [...]}.
#
#   scripts/container_allreduce.sh [IMAGE]        default localhost/flyte-hvd:latest
#
# mpiexec runs here (the checkout's venv: the same mpich wheel as the image); its ssh launcher
# is `podman exec` into the container named after each host, and the ranks run the
# checkout's benchmarks/ (mounted read-only).
set -euo pipefail
cd "$(dirname "$0")/.."
image="${1:-localhost/flyte-hvd:latest}"
sizes=4096,1048576,16777216,67108864
[ "$(id -u)" = 0 ] || { echo "container_allreduce: needs root" >&2; exit 1; }
for tool in podman .venv/bin/mpiexec; do
  command -v "$tool" >/dev/null || { echo "container_allreduce: $tool not found" >&2; exit 1; }
done
podman image exists "$image" || { echo "container_allreduce: no image $image: make image" >&2; exit 1; }
export CONTAINERS_CONF="$PWD/docker/containers.conf"
net="flyte-hvd-bench-$$"
work=$(mktemp -d)
cleanup() {
  podman rm --force --time 0 "$net-a" "$net-b" >/dev/null 2>&1 || true
  podman network rm --force "$net" >/dev/null 2>&1 || true
  rm -rf "$work"
}
trap cleanup EXIT
cat >"$work/launcher.sh" <<LAUNCHER
#!/bin/sh
# hydra's ssh launcher: LAUNCHER [options] HOST COMMAND..., here podman exec into HOST's container
while [ "\${1#-}" != "\$1" ]; do shift; done
host=\$1; shift
command=\$(echo "\$*" | sed "s|[^ \"']*/hydra_pmi_proxy|/opt/venv/bin/hydra_pmi_proxy|")
exec podman exec -i "\$(cat $work/hosts/\$host)" sh -c "\$command"
LAUNCHER
chmod +x "$work/launcher.sh"
mkdir "$work/hosts"
podman network create --internal "$net" >/dev/null
hosts=""
for c in a b; do
  podman run --detach --runtime runc --ulimit host --name "$net-$c" --hostname "bench-$c" \
    --network "$net" --volume "$PWD/benchmarks:/bench/benchmarks:ro" "$image" sleep 3600 >/dev/null
  ip=$(podman inspect --format '{{range .NetworkSettings.Networks}}{{.IPAddress}}{{end}}' "$net-$c")
  echo "$net-$c" >"$work/hosts/$ip"
  hosts="${hosts:+$hosts,}$ip"
done
mpi=(.venv/bin/mpiexec -genvnone -genv PATH /opt/venv/bin:/usr/bin:/bin -genv PYTHONPATH /bench
  -genv MPIR_CVAR_CH4_NETMOD ofi -genv FI_PROVIDER tcp -genv MPIR_CVAR_NOLOCAL 1
  -launcher ssh -launcher-exec "$work/launcher.sh"
  -iface "$(podman network inspect "$net" --format '{{.NetworkInterface}}')" -n 2 -ppn 1 -wdir /tmp)
rank=(python -m benchmarks.allreduce --raw-json - --sizes "$sizes")
echo "two containers:"
timeout 300 "${mpi[@]}" -genv FI_TCP_IFACE eth0 -hosts "$hosts" "${rank[@]}" | grep '^{'
echo "one container:"
timeout 300 "${mpi[@]}" -genv FI_TCP_IFACE lo -hosts "${hosts%%,*},${hosts%%,*}" "${rank[@]}" | grep '^{'
