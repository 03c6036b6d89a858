#!/usr/bin/env bash
# CI setup for the real multi-host test (tests/multirank/test_multihost.py): the tools
# scripts/netns_cluster.sh needs. Idempotent and fast when everything is installed already.
set -euo pipefail
missing=()
command -v ip >/dev/null 2>&1 || missing+=(iproute2)
command -v sshd >/dev/null 2>&1 || [ -x /usr/sbin/sshd ] || missing+=(openssh-server)
command -v ssh >/dev/null 2>&1 || missing+=(openssh-client)
command -v pdsh >/dev/null 2>&1 || missing+=(pdsh)
if [ ${#missing[@]} -eq 0 ]; then
    echo "multihost_setup: iproute2, openssh-server, openssh-client, pdsh already installed"
    exit 0
fi
[ "$(id -u)" = 0 ] || { echo "multihost_setup: need root to install: ${missing[*]}" >&2; exit 1; }
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${missing[@]}"
echo "multihost_setup: installed ${missing[*]}"
