#!/usr/bin/env bash
# A real SLURM cluster on this one machine, for tests and trials of `areal-flow slurm` jobs.
#
#   bash scripts/slurm_local.sh start    # install slurm-wlm + munge (apt) if missing, write
#                                        # /etc/slurm/slurm.conf, start munged, slurmctld and one
#                                        # slurmd per node; return once every node is idle
#   bash scripts/slurm_local.sh status   # the daemons this script started, and sinfo
#   bash scripts/slurm_local.sh stop     # cancel the cluster's jobs, stop those daemons
#
# Nodes: SLURM_LOCAL_NODES (default 3) nodes af-node1, af-node2, ..., each a `slurmd -N NAME` on
# this machine, so a job can have a server node and two training nodes. Jobs reach each other by
# node name (health checks, torchrun's rendezvous): names that do not resolve are added to
# /etc/hosts as 127.0.0.1 (one marked line, removed by `stop`). Each node offers all of this
# machine's CPUs (nproc) and 95% of its memory: the nodes are emulated, they share the machine.
# Plugins that need no cgroups or systemd (they work in containers): proctrack/linuxproc,
# task/none, select/cons_tres with CR_CPU, no accounting (sacct has nothing; use scontrol show job,
# which keeps a finished job for MinJobAge = 10 min).
#
# Environment: SLURM_LOCAL_DIR (state, logs and pid files; default /tmp/areal-flow-slurm),
# SLURM_LOCAL_NODES (how many nodes), SLURM_LOCAL_TIMEOUT (seconds `start` waits for idle nodes,
# default 60). Needs root (re-runs itself with sudo when it can). `start` twice is fine; `stop`
# stops only daemons whose pid files it wrote (a munged that was already running is left alone).
set -euo pipefail

STATE=${SLURM_LOCAL_DIR:-/tmp/areal-flow-slurm}
TIMEOUT=${SLURM_LOCAL_TIMEOUT:-60}
CONF=/etc/slurm/slurm.conf
MARK="# written by areal_flow scripts/slurm_local.sh"
PARTITION=local
CTLD_PORT=6817
SLURMD_PORT=6818  # the first node's; the next ones count up

say() { echo "slurm_local: $*"; }
die() { echo "slurm_local: $*" >&2; exit 1; }

if [ "$(id -u)" -ne 0 ]; then
  command -v sudo >/dev/null || die "needs root (apt, /etc/slurm, the daemons)"
  exec sudo --preserve-env=SLURM_LOCAL_DIR,SLURM_LOCAL_NODES,SLURM_LOCAL_TIMEOUT \
    bash "$0" "$@"
fi

node_names() {
  local count=${SLURM_LOCAL_NODES:-3} i
  [[ $count =~ ^[1-9][0-9]?$ ]] || die "SLURM_LOCAL_NODES must be a number of nodes: '$count'"
  for ((i = 1; i <= count; i++)); do echo "af-node$i"; done
}

HOSTS_MARK="# areal_flow scripts/slurm_local.sh nodes"

resolve_nodes() {  # every node name resolves (to this machine): add the ones that do not
  local missing=() name
  for name in $(node_names); do getent hosts "$name" >/dev/null || missing+=("$name"); done
  [ ${#missing[@]} -eq 0 ] && return
  unresolve_nodes
  # written in place (a container's /etc/hosts is often a bind mount that cannot be renamed)
  echo "127.0.0.1 $(node_names | paste -sd' ') $HOSTS_MARK" >> /etc/hosts
  for name in $(node_names); do
    getent hosts "$name" >/dev/null || die "node name '$name' does not resolve, even in /etc/hosts"
  done
}

unresolve_nodes() {
  grep -qF "$HOSTS_MARK" /etc/hosts 2>/dev/null || return 0
  local kept
  kept=$(grep -vF "$HOSTS_MARK" /etc/hosts)
  echo "$kept" > /etc/hosts
}

install() {
  if command -v slurmctld >/dev/null && command -v slurmd >/dev/null \
      && command -v sbatch >/dev/null && command -v munged >/dev/null; then
    return
  fi
  command -v apt-get >/dev/null || die "slurm-wlm and munge are missing and there is no apt-get"
  say "installing slurm-wlm and munge with apt"
  local began=$SECONDS
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -q >/dev/null || die "apt-get update failed"
  apt-get install -y -q --no-install-recommends slurm-wlm munge >/dev/null \
    || die "apt-get install slurm-wlm munge failed"
  say "installed in $((SECONDS - began)) s"
}

write_conf() {  # the config for this host, on stdout
  local cpus mem port=$SLURMD_PORT name
  cpus=$(nproc)
  mem=$(awk '/^MemTotal:/ {print int($2 / 1024 * 0.95)}' /proc/meminfo)
  cat <<EOF
$MARK: a one-machine cluster
ClusterName=areal-flow-local
SlurmctldHost=$(hostname -s)(127.0.0.1)
SlurmctldPort=$CTLD_PORT
SlurmdPort=$SLURMD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation=$STATE/state
SlurmdSpoolDir=$STATE/spool/slurmd-%n
SlurmctldPidFile=$STATE/slurmctld.pid
SlurmdPidFile=$STATE/slurmd-%n.pid
SlurmctldLogFile=$STATE/log/slurmctld.log
SlurmdLogFile=$STATE/log/slurmd-%n.log
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
KillWait=30
MinJobAge=600
InactiveLimit=0
EOF
  for name in $(node_names); do
    echo "NodeName=$name Port=$port CPUs=$cpus RealMemory=$mem State=UNKNOWN"
    port=$((port + 1))
  done
  echo "PartitionName=$PARTITION Nodes=ALL Default=YES MaxTime=INFINITE State=UP"
}

alive() {  # the pid in FILE runs a daemon of ours (slurmd-af-node1.pid: a slurmd), not a
  # process that got the number after ours died
  local file=$1 name
  name=$(basename "$file" .pid)
  [ -s "$file" ] && [ "$(ps -o comm= -p "$(cat "$file")" 2>/dev/null)" = "${name%%-*}" ]
}

all_idle() {  # every node of the config idle (sinfo answers)
  local states
  states=$(sinfo -h -N -p "$PARTITION" -o "%T" 2>/dev/null) || return 1
  [ -n "$states" ] && [ -z "$(grep -vx idle <<<"$states")" ]
}

running() {  # every daemon of the config runs and the controller answers
  local name
  alive "$STATE/slurmctld.pid" || return 1
  for name in $(node_names); do alive "$STATE/slurmd-$name.pid" || return 1; done
  scontrol ping >/dev/null 2>&1
}

log_tails() {  # the daemons' last log lines (this start's: the logs are emptied at start)
  local file name
  for name in slurmctld $(node_names | sed 's/^/slurmd-/'); do
    file=$STATE/log/$name.log
    [ -e "$file" ] || continue
    echo "--- $file (last 15 lines)" >&2
    tail -n 15 "$file" >&2
  done
}

start_munge() {
  if munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
    return  # a munged already answers (started by systemd or by hand): use it, leave it be
  fi
  [ -s /etc/munge/munge.key ] || { mungekey --create --keyfile /etc/munge/munge.key 2>/dev/null \
    || dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none; }
  chown munge:munge /etc/munge/munge.key
  chmod 400 /etc/munge/munge.key
  mkdir -p /run/munge /var/lib/munge /var/log/munge
  chown munge:munge /run/munge /var/lib/munge /var/log/munge
  runuser -u munge -- /usr/sbin/munged  # forks; writes /run/munge/munged.pid
  local deadline=$((SECONDS + 10))
  until munge -n 2>/dev/null | unmunge >/dev/null 2>&1; do
    [ $SECONDS -lt $deadline ] || die "munged does not answer after 10 s (see /var/log/munge)"
    sleep 0.2
  done
  cp /run/munge/munged.pid "$STATE/munged.pid"
}

start() {
  local began=$SECONDS conf name
  install
  resolve_nodes
  mkdir -p "$STATE/state" "$STATE/spool" "$STATE/log"
  conf=$(write_conf)
  if [ -e "$CONF" ] && ! grep -qxF "$MARK: a one-machine cluster" "$CONF"; then
    die "$CONF exists and was not written by this script: not touching it"
  fi
  if running && [ "$(cat "$CONF")" = "$conf" ]; then
    say "already running: $(node_names | paste -sd' ') ($STATE)"
    return
  fi
  stop_daemons  # ours, if a different config or a half-started cluster runs
  mkdir -p /etc/slurm
  echo "$conf" > "$CONF"
  start_munge
  rm -f "$STATE"/log/*.log
  slurmctld -c  # -c: no jobs or node states from an earlier start
  for name in $(node_names); do slurmd -N "$name"; done
  local deadline=$((SECONDS + TIMEOUT))
  until all_idle; do
    if [ $SECONDS -ge $deadline ]; then
      echo "slurm_local: the nodes are not idle after $TIMEOUT s:" >&2
      sinfo -N -l >&2 || true
      log_tails
      die "the daemons are left running to look at; stop them with: bash $0 stop"
    fi
    sleep 0.5
  done
  say "cluster up in $((SECONDS - began)) s: nodes $(node_names | paste -sd' '), partition" \
      "$PARTITION ($STATE)"
}

stop_pid_file() {  # TERM the pid in FILE, KILL after 15 s, then forget it
  local file=$1 pid deadline
  alive "$file" || { rm -f "$file"; return; }
  pid=$(cat "$file")
  kill "$pid"
  deadline=$((SECONDS + 15))
  while alive "$file" && [ $SECONDS -lt $deadline ]; do sleep 0.2; done
  if alive "$file"; then kill -9 "$pid"; fi
  rm -f "$file"
}

stop_daemons() {
  local file
  for file in "$STATE"/slurmd-*.pid; do [ -e "$file" ] && stop_pid_file "$file"; done
  stop_pid_file "$STATE/slurmctld.pid"
}

stop() {
  local jobs deadline
  if alive "$STATE/slurmctld.pid" && jobs=$(squeue -h -o %A 2>/dev/null) && [ -n "$jobs" ]; then
    say "cancelling jobs $(echo $jobs)"
    scancel $jobs || true
    deadline=$((SECONDS + 45))  # KillWait (30 s), then SIGKILL
    while [ -n "$(squeue -h -o %A 2>/dev/null)" ] && [ $SECONDS -lt $deadline ]; do sleep 0.5; done
  fi
  stop_daemons
  stop_pid_file "$STATE/munged.pid"  # only when this script started it
  unresolve_nodes
  say "stopped"
}

status() {
  local file
  for file in "$STATE"/*.pid; do
    [ -e "$file" ] || continue
    if alive "$file"; then echo "$(basename "$file" .pid): running, pid $(cat "$file")"
    else echo "$(basename "$file" .pid): not running (stale pid file)"; fi
  done
  scontrol ping >/dev/null 2>&1 || { echo "no SLURM controller answers"; return 1; }
  sinfo -N -l
}

case ${1:-} in
  start) start ;;
  stop) stop ;;
  status) status ;;
  *) echo "usage: $0 start|stop|status" >&2; exit 2 ;;
esac
