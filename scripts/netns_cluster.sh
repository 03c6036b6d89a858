#!/usr/bin/env bash
# A throw-away multi-host cluster on ONE Linux machine, for testing real multi-node launches.
#
#   sudo scripts/netns_cluster.sh up      # build it; prints the hostfile path
#   sudo scripts/netns_cluster.sh status  # show hosts, sshd pids and whether ssh works
#   sudo scripts/netns_cluster.sh down    # tear it all down (idempotent, always safe to run)
#
# Layout (defaults): a bridge ztmhbr0 (10.231.0.254/24) in the root namespace and one network
# namespace per host (ztmh1, ztmh2, ...), each with a veth end named ztnet0 inside (the same
# name everywhere, so GLOO_SOCKET_IFNAME=ztnet0 works on every host), address 10.231.0.N, lo up
# and its own sshd (ListenAddress = its address, PidFile in the state dir). A passwordless key
# in the state dir is added to root's authorized_keys with a marker comment, and root's
# ~/.ssh/config gets a marked block for these addresses only (StrictHostKeyChecking no).
# The state dir holds the hostfile, a .deepspeed_env and the sshd logs.
#
# The hosts share this machine's file system (same venv, same code), like an NFS-backed cluster.
# Only the test addresses 10.231.0.0/24 are ever configured or contacted.
#
# Settings (environment): ZT_CLUSTER_HOSTS (2), ZT_CLUSTER_SLOTS (1 per host),
# ZT_CLUSTER_STATE (/tmp/zerotrain-netns). The subnet is fixed on purpose.
set -euo pipefail

HOSTS="${ZT_CLUSTER_HOSTS:-2}"
SLOTS="${ZT_CLUSTER_SLOTS:-1}"
STATE="${ZT_CLUSTER_STATE:-/tmp/zerotrain-netns}"
SUBNET="10.231.0"          # private test subnet; nothing outside it is touched
BRIDGE="ztmhbr0"
BRIDGE_ADDR="$SUBNET.254"
NS_PREFIX="ztmh"           # namespaces ztmh1..N, root-side veth ends ztmhv1..N
IFNAME="ztnet0"            # the veth end inside every namespace
MARKER="zerotrain-netns-cluster"
SSH_DIR="/root/.ssh"
KEY="$STATE/id_ed25519"

die() { echo "netns_cluster.sh: $*" >&2; exit 1; }
addr_of() { echo "$SUBNET.$1"; }

preflight() {
    [ "$(id -u)" = 0 ] || die "must run as root (network namespaces, sshd)"
    local missing=() tool
    for tool in ip sshd ssh ssh-keygen pdsh; do
        command -v "$tool" >/dev/null 2>&1 || [ -x "/usr/sbin/$tool" ] || missing+=("$tool")
    done
    [ ${#missing[@]} -eq 0 ] || die "missing: ${missing[*]}; install with: apt-get install -y openssh-server openssh-client pdsh iproute2"
    ip netns list >/dev/null 2>&1 || die "'ip netns' does not work here (needs root in the initial network namespace)"
    [[ "$HOSTS" =~ ^[1-9]$ ]] || die "ZT_CLUSTER_HOSTS must be 1..9 (got $HOSTS)"
    [[ "$SLOTS" =~ ^[1-9][0-9]*$ ]] || die "ZT_CLUSTER_SLOTS must be a positive integer (got $SLOTS)"
}

sshd_bin() { command -v sshd 2>/dev/null || echo /usr/sbin/sshd; }

up() {
    preflight
    down quiet
    # Refuse if the test subnet is already in use on this machine by something that is not ours.
    if ip -o -4 addr show | grep -q " $SUBNET\."; then
        die "addresses in $SUBNET.0/24 already exist on this machine (ip -o addr); refusing to touch them"
    fi
    mkdir -p "$STATE" /run/sshd
    chmod 700 "$STATE"

    ip link add "$BRIDGE" type bridge
    ip addr add "$BRIDGE_ADDR/24" dev "$BRIDGE"
    ip link set "$BRIDGE" up

    ssh-keygen -q -t ed25519 -N "" -C "$MARKER" -f "$KEY"
    ssh-keygen -q -t ed25519 -N "" -C "$MARKER-host" -f "$STATE/ssh_host_ed25519_key"

    local i ns addr
    : > "$STATE/hostfile"
    for i in $(seq 1 "$HOSTS"); do
        ns="$NS_PREFIX$i"; addr="$(addr_of "$i")"
        ip netns add "$ns"
        ip link add "${NS_PREFIX}v$i" type veth peer name "${NS_PREFIX}p$i"
        ip link set "${NS_PREFIX}v$i" master "$BRIDGE" up
        ip link set "${NS_PREFIX}p$i" netns "$ns"
        ip -n "$ns" link set "${NS_PREFIX}p$i" name "$IFNAME"
        ip -n "$ns" addr add "$addr/24" dev "$IFNAME"
        ip -n "$ns" link set "$IFNAME" up
        ip -n "$ns" link set lo up
        # A hermetic sshd config: key-only root login, nothing from /etc/ssh/sshd_config.d.
        cat > "$STATE/sshd_config.$i" <<EOF
ListenAddress $addr
Port 22
HostKey $STATE/ssh_host_ed25519_key
PidFile $STATE/sshd.$i.pid
PermitRootLogin prohibit-password
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
PrintMotd no
AuthorizedKeysFile .ssh/authorized_keys
EOF
        ip netns exec "$ns" "$(sshd_bin)" -f "$STATE/sshd_config.$i" -E "$STATE/sshd.$i.log"
        echo "$addr slots=$SLOTS" >> "$STATE/hostfile"
    done

    # The client side: our key in authorized_keys (marked), our addresses in ssh config (marked).
    mkdir -p "$SSH_DIR"; chmod 700 "$SSH_DIR"
    touch "$SSH_DIR/authorized_keys"; chmod 600 "$SSH_DIR/authorized_keys"
    cat "$KEY.pub" >> "$SSH_DIR/authorized_keys"
    local hosts_line tmp
    hosts_line="$(for i in $(seq 1 "$HOSTS"); do printf '%s ' "$(addr_of "$i")"; done)"
    tmp="$(mktemp "$SSH_DIR/config.XXXXXX")"
    {   # first match wins in ssh_config, so our block goes on top
        echo "# >>> $MARKER >>>"
        echo "Host ${hosts_line% }"
        echo "    User root"
        echo "    IdentityFile $KEY"
        echo "    IdentitiesOnly yes"
        echo "    StrictHostKeyChecking no"
        echo "    UserKnownHostsFile /dev/null"
        echo "    LogLevel ERROR"
        echo "    BatchMode yes"
        echo "    ConnectTimeout 5"
        echo "# <<< $MARKER <<<"
        [ -f "$SSH_DIR/config" ] && cat "$SSH_DIR/config"
    } > "$tmp"
    chmod 600 "$tmp"; mv "$tmp" "$SSH_DIR/config"

    # The launcher exports this file on every host; see docs/multihost.md.
    echo "GLOO_SOCKET_IFNAME=$IFNAME" > "$STATE/.deepspeed_env"

    for i in $(seq 1 "$HOSTS"); do
        wait_ssh "$(addr_of "$i")" || { status >&2 || true; die "sshd on $(addr_of "$i") did not answer; see $STATE/sshd.$i.log"; }
    done
    echo "cluster up: $HOSTS hosts ($(addr_of 1)..$(addr_of "$HOSTS")), interface $IFNAME"
    echo "hostfile: $STATE/hostfile"
    echo "env file: $STATE/.deepspeed_env"
}

wait_ssh() {
    local n
    for n in $(seq 1 50); do
        ssh -o ConnectTimeout=2 "$1" true >/dev/null 2>&1 && return 0
        sleep 0.2
    done
    return 1
}

status() {
    local i ns pid
    for i in $(seq 1 9); do
        ns="$NS_PREFIX$i"
        ip netns list 2>/dev/null | grep -qw "^$ns" || continue
        pid="$(cat "$STATE/sshd.$i.pid" 2>/dev/null || echo -)"
        if timeout 10 ssh -o ConnectTimeout=3 "$(addr_of "$i")" true >/dev/null 2>&1; then
            echo "$ns $(addr_of "$i") sshd=$pid ssh=ok"
        else
            echo "$ns $(addr_of "$i") sshd=$pid ssh=FAILED"
        fi
    done
}

down() {
    [ "$(id -u)" = 0 ] || die "must run as root"
    local i ns pid
    for i in $(seq 1 9); do
        ns="$NS_PREFIX$i"
        if [ -f "$STATE/sshd.$i.pid" ]; then
            pid="$(cat "$STATE/sshd.$i.pid" 2>/dev/null || true)"
            # only kill it if that pid is still an sshd (pid files can go stale)
            if [ -n "$pid" ] && grep -q sshd "/proc/$pid/comm" 2>/dev/null; then kill "$pid" 2>/dev/null || true; fi
        fi
        if ip netns list 2>/dev/null | grep -qw "^$ns"; then
            # anything still running on that test host (sshd children, stray ranks) dies with it
            for pid in $(ip netns pids "$ns" 2>/dev/null); do kill -9 "$pid" 2>/dev/null || true; done
            ip netns del "$ns" 2>/dev/null || true
        fi
        ip link del "${NS_PREFIX}v$i" 2>/dev/null || true
    done
    ip link del "$BRIDGE" 2>/dev/null || true
    if [ -f "$SSH_DIR/authorized_keys" ]; then
        sed -i "/ $MARKER\$/d" "$SSH_DIR/authorized_keys"
    fi
    if [ -f "$SSH_DIR/config" ]; then
        sed -i "/^# >>> $MARKER >>>\$/,/^# <<< $MARKER <<<\$/d" "$SSH_DIR/config"
    fi
    rm -rf "$STATE"
    [ "${1:-}" = quiet ] || echo "cluster down"
}

case "${1:-}" in
    up) up ;;
    down) down ;;
    status) status ;;
    *) echo "usage: $0 up|down|status" >&2; exit 2 ;;
esac
