#!/usr/bin/env bash
# A single-node Slurm cluster on this machine, for the tests of `topk-nb run --executor slurm` (and CI).
#
#   tools/slurm.sh start    write a slurm.conf for this host, start munged, slurmctld and slurmd (as root), wait for the node
#   tools/slurm.sh stop     stop exactly the daemons `start` started (their pids are recorded), remove the state folder
#   tools/slurm.sh status   say whether the cluster answers (sinfo)
#   tools/slurm.sh env      print `export SLURM_CONF=...`: the Slurm commands of a shell find the cluster with it
#
# Needs Debian's slurm-wlm and munge packages (apt-get install slurm-wlm munge) and root. The cluster's files live in
# $TOPK_NB_SLURM_DIR (default /tmp/topk-nb-slurm); the commands find it through SLURM_CONF=$TOPK_NB_SLURM_DIR/slurm.conf,
# which the tests set themselves when that file exists. Nothing outside that folder is written.
set -euo pipefail

dir=${TOPK_NB_SLURM_DIR:-/tmp/topk-nb-slurm}
conf=$dir/slurm.conf

die() { echo "tools/slurm.sh: $*" >&2; exit 1; }

answers() { SLURM_CONF=$conf timeout 10 sinfo -h -N -o "%t" 2>/dev/null | grep -qE '^(idle|mix|alloc)'; }

start() {
    [ "$(id -u)" = 0 ] || die "start needs root (slurmd runs the jobs as their users)"
    for cmd in munged slurmctld slurmd sinfo; do
        command -v $cmd >/dev/null || die "$cmd not found: apt-get install slurm-wlm munge"
    done
    if [ -f "$dir/pids" ]; then
        answers && { echo "slurm: already running ($conf)"; return 0; }
        stop
    fi
    mkdir -p "$dir" && chmod 711 "$dir"
    mkdir -p "$dir/state" "$dir/spool" "$dir/munge"
    chmod 711 "$dir/munge"
    local host cpus mem
    host=$(hostname -s)
    cpus=$(nproc)
    mem=$(( $(awk '/^MemTotal:/ {print $2}' /proc/meminfo) / 1024 * 9 / 10 ))
    dd if=/dev/urandom of="$dir/munge/munge.key" bs=1024 count=1 status=none
    chmod 400 "$dir/munge/munge.key"
    cat > "$conf" <<EOF
# written by tools/slurm.sh: one node, this host, no accounting; cred_expire=10: a requeued job may start again after 10 s (not 120)
ClusterName=topknb
SlurmctldHost=$host
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$dir/munge/munge.socket,cred_expire=10
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/slurmctld.log
SlurmdLogFile=$dir/slurmd.log
SlurmctldPort=${TOPK_NB_SLURM_PORT:-16817}
SlurmdPort=$(( ${TOPK_NB_SLURM_PORT:-16817} + 1 ))
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
SchedulerType=sched/backfill
MpiDefault=none
ReturnToService=2
JobRequeue=1
MinJobAge=600
KillWait=10
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
DefMemPerCPU=1024
NodeName=$host CPUs=$cpus RealMemory=$mem State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP
EOF
    : > "$dir/pids"
    munged --force --key-file="$dir/munge/munge.key" --socket="$dir/munge/munge.socket" \
        --pid-file="$dir/munge/munged.pid" --log-file="$dir/munge/munged.log" --seed-file="$dir/munge/munge.seed" \
        --foreground >> "$dir/munge/munged.out" 2>&1 &
    echo $! >> "$dir/pids"
    for _ in $(seq 50); do [ -S "$dir/munge/munge.socket" ] && break; sleep 0.1; done
    [ -S "$dir/munge/munge.socket" ] || die "munged did not start: see $dir/munge/munged.log"
    slurmctld -D -c -f "$conf" >> "$dir/slurmctld.out" 2>&1 &
    echo $! >> "$dir/pids"
    slurmd -D -c -f "$conf" >> "$dir/slurmd.out" 2>&1 &
    echo $! >> "$dir/pids"
    for _ in $(seq 60); do answers && break; sleep 0.5; done
    answers || { echo "the node did not come up; last lines of $dir/slurmctld.log and slurmd.log:" >&2
                 tail -n 5 "$dir/slurmctld.log" "$dir/slurmd.log" >&2 || true; stop; exit 1; }
    echo "slurm: node $host idle ($cpus CPUs, $mem MB); export SLURM_CONF=$conf"
}

stop() {
    [ -f "$dir/pids" ] || { echo "slurm: not started by tools/slurm.sh ($dir/pids missing)"; return 0; }
    local pids
    if answers; then                        # the cluster's jobs first: their processes would outlive slurmd
        SLURM_CONF=$conf scancel --partition=debug 2>/dev/null || true
        for _ in $(seq 40); do [ -z "$(SLURM_CONF=$conf squeue -h -t running,completing 2>/dev/null)" ] && break; sleep 0.5; done
    fi
    pids=$(tac "$dir/pids")                 # slurmd, slurmctld, then munged
    for pid in $pids; do kill -TERM "$pid" 2>/dev/null || true; done
    for pid in $pids; do
        for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
        kill -0 "$pid" 2>/dev/null && kill -KILL "$pid" 2>/dev/null || true
    done
    rm -rf "$dir"
    echo "slurm: stopped"
}

case "${1:-}" in
    start) start ;;
    stop) stop ;;
    status) if answers; then SLURM_CONF=$conf sinfo; else echo "slurm: no cluster answers at $conf"; exit 1; fi ;;
    env) echo "export SLURM_CONF=$conf" ;;
    *) echo "usage: tools/slurm.sh start|stop|status|env" >&2; exit 2 ;;
esac
