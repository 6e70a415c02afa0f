#!/usr/bin/env bash
# Installs the Debian packages of the cluster lab (fsdp_ext.lab) when they are missing
# (etcd-server for `--rdzv etcd`; its Python client, python-etcd, is in the dev extra).
#   scripts/lab-packages.sh               # `make lab`: fails loudly if it cannot install
#   scripts/lab-packages.sh --best-effort # `make test`: one line and exit 0 if it cannot
#                                         # (the lab tests then skip, saying why)
# Quiet and idempotent: prints nothing when everything is installed.
set -uo pipefail
# etcd-server: the rendezvous of `--rdzv etcd` (Debian 12 ships etcd 3.4, v2 API)
# faketime: the clock-skew tests of one writer per directory
PACKAGES=(iproute2 sshfs openssh-server etcd-server faketime)
best_effort=false
[[ ${1:-} == --best-effort ]] && best_effort=true

give_up() {
    echo "lab packages: $1" >&2
    if $best_effort; then exit 0; else exit 1; fi
}

missing=()
for package in "${PACKAGES[@]}"; do
    if ! dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q "install ok installed"; then
        missing+=("$package")
    fi
done
[[ ${#missing[@]} -eq 0 ]] && exit 0
command -v apt-get >/dev/null || give_up "no apt-get; install ${missing[*]} by hand"
[[ $(id -u) -eq 0 ]] || give_up "not root; run: sudo apt-get install -y ${missing[*]}"

log=$(mktemp)
# openssh-server would start a system-wide sshd on the host; the lab runs its own sshd in
# a namespace, so service starts are refused for the duration of the install
policy=/usr/sbin/policy-rc.d
own_policy=false
if [[ ! -e $policy ]]; then
    printf '#!/bin/sh\nexit 101\n' >"$policy" && chmod +x "$policy" && own_policy=true
fi
export DEBIAN_FRONTEND=noninteractive
install() { apt-get install -y -q --no-install-recommends "${missing[@]}" >>"$log" 2>&1; }
echo "lab packages: installing ${missing[*]}" >&2
install || { apt-get update -q >>"$log" 2>&1 && install; }
status=$?
$own_policy && rm -f "$policy"
if [[ $status -ne 0 ]]; then
    reason=$(grep -E '^(E|W):' "$log" | head -1)
    rm -f "$log"
    give_up "apt-get install ${missing[*]} failed: ${reason:-see apt-get output}"
fi
rm -f "$log"
