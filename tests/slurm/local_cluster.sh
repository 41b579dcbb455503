#!/usr/bin/env bash
# A one-host SLURM cluster for the tests (and for trying `hydra/launcher=slurm` by hand), as root on Debian.
#
#   tests/slurm/local_cluster.sh start    install what is missing, start the daemons, wait until the nodes are idle
#   tests/slurm/local_cluster.sh stop     cancel this cluster's jobs, stop only the daemons this script started
#   tests/slurm/local_cluster.sh status   sinfo, and which daemons this script started
#
# Cluster "disttrain": slurmctld, SLURM_NODES fake nodes n1..nN (one `slurmd -N nX` each, all on this host),
# slurmdbd + a private MariaDB for accounting (without accounting, submitit cannot see that a job died without
# writing its result and waits forever), munge for authentication. Everything talks over 127.0.0.1; MariaDB
# listens on 127.0.0.1 only. There is no systemd here: daemons are started directly and their PIDs recorded in
# $RUN_DIR/pids, and `stop` signals exactly those PIDs. `start` is idempotent: packages, the database, the
# config and running daemons are reused.
set -euo pipefail

NODES=${SLURM_NODES:-2}
CPUS_PER_NODE=${SLURM_CPUS_PER_NODE:-4}   # virtual: jobs of the tests are tiny and share the real cores
STATE_DIR=/var/lib/disttrain-slurm
RUN_DIR=/run/disttrain-slurm
PID_DIR=$RUN_DIR/pids
LOG_DIR=$STATE_DIR/log
ETC=/etc/slurm
MARKER="# written by disttrain tests/slurm/local_cluster.sh"
DB_PORT=${SLURM_DB_PORT:-36306}
CTLD_PORT=6817
DBD_PORT=6819
NODE_PORT_BASE=17000
HOST=$(hostname -s)
PACKAGES=(munge slurm-client slurmctld slurmd slurmdbd mariadb-server)

say() { echo "local_cluster: $*"; }
die() { echo "local_cluster: error: $*" >&2; exit 1; }

alive() { [[ -n "${1:-}" ]] && kill -0 "$1" 2>/dev/null; }
pid_of() { [[ -f "$1" ]] && cat "$1" 2>/dev/null || true; }
# A daemon's pid file can be rewritten right after it first appears (one CI run: slurmd-n1.pid gone between the
# check and the copy): copy it as part of the wait, retried until it succeeds.
record_pid() { [[ -s "$1" ]] && cp "$1" "$2"; }  # record_pid DAEMON_PID_FILE OUR_RECORD
started_by_us() { alive "$(pid_of "$PID_DIR/$1")"; }

wait_for() {  # wait_for SECONDS DESCRIPTION COMMAND...
  local limit=$1 what=$2; shift 2
  for ((i = 0; i < limit * 4; i++)); do
    if "$@" >/dev/null 2>&1; then return 0; fi
    sleep 0.25
  done
  die "$what did not come up within ${limit}s (logs: $LOG_DIR)"
}

install_packages() {
  local missing=()
  for p in "${PACKAGES[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
  ((${#missing[@]} == 0)) && return 0
  say "installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  # Package scripts try to start services through systemd/invoke-rc.d; there is none, and we start them ourselves.
  apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null 2>&1 \
    || { apt-get update -q >/dev/null && apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null; } \
    || die "apt-get install ${missing[*]} failed"
}

write_configs() {
  for f in slurm.conf slurmdbd.conf; do
    if [[ -f $ETC/$f ]] && ! grep -qF "$MARKER" "$ETC/$f"; then
      die "$ETC/$f exists and was not written by this script: refusing to replace a real cluster's config"
    fi
  done
  mkdir -p "$ETC" "$STATE_DIR/ctld" "$LOG_DIR"
  local nodes="" names=""
  for ((n = 1; n <= NODES; n++)); do
    mkdir -p "$STATE_DIR/slurmd/n$n"
    nodes+="NodeName=n$n NodeHostname=$HOST NodeAddr=127.0.0.1 Port=$((NODE_PORT_BASE + n)) CPUs=$CPUS_PER_NODE"
    nodes+=" RealMemory=4000 State=UNKNOWN"$'\n'
    names+="${names:+,}n$n"
  done
  cat >"$ETC/slurm.conf.new" <<EOF
$MARKER
ClusterName=disttrain
SlurmctldHost=$HOST(127.0.0.1)
SlurmctldPort=$CTLD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
# A requeued job waits cred_expire seconds before it may start again (default 120): short for a test cluster.
AuthInfo=cred_expire=10
StateSaveLocation=$STATE_DIR/ctld
SlurmdSpoolDir=$STATE_DIR/slurmd/%n
SlurmctldPidFile=$RUN_DIR/slurmctld.pid
SlurmdPidFile=$RUN_DIR/slurmd-%n.pid
SlurmctldLogFile=$LOG_DIR/slurmctld.log
SlurmdLogFile=$LOG_DIR/slurmd-%n.log
# No cgroups in this container: track processes through /proc, no task binding.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
# The fake nodes declare more CPUs than the host has; slurmd must accept the config's numbers.
SlurmdParameters=config_overrides
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2
MpiDefault=none
ReturnToService=2
JobRequeue=1
KillWait=5
MinJobAge=600
MessageTimeout=20
SlurmdTimeout=120
InactiveLimit=0
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=127.0.0.1
AccountingStoragePort=$DBD_PORT
JobCompType=jobcomp/none
$nodes
PartitionName=debug Nodes=$names Default=YES MaxTime=INFINITE State=UP
EOF
  mv "$ETC/slurm.conf.new" "$ETC/slurm.conf"
  umask 077
  cat >"$ETC/slurmdbd.conf.new" <<EOF
$MARKER
AuthType=auth/munge
DbdAddr=127.0.0.1
DbdHost=localhost
DbdPort=$DBD_PORT
SlurmUser=root
PidFile=$RUN_DIR/slurmdbd.pid
LogFile=$LOG_DIR/slurmdbd.log
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=$DB_PORT
StorageUser=slurm
StorageLoc=slurm_acct_db
EOF
  mv "$ETC/slurmdbd.conf.new" "$ETC/slurmdbd.conf"
  umask 022
}

start_munge() {
  if pgrep -x munged >/dev/null; then return 0; fi  # a running munged (ours or the system's) serves everyone
  [[ -f /etc/munge/munge.key ]] || { mungekey --create >/dev/null 2>&1 || die "cannot create /etc/munge/munge.key"; }
  chown munge:munge /etc/munge/munge.key && chmod 400 /etc/munge/munge.key
  mkdir -p /run/munge /var/log/munge /var/lib/munge && chown munge:munge /run/munge /var/log/munge /var/lib/munge
  chmod 755 /run/munge
  runuser -u munge -- /usr/sbin/munged
  wait_for 10 munged test -S /run/munge/munge.socket.2
  wait_for 10 "munged pid" record_pid /run/munge/munged.pid "$PID_DIR/munged"
}

db_sql() { mariadb --no-defaults --socket="$RUN_DIR/mysqld.sock" -uroot -e "$1"; }

start_database() {
  local datadir=$STATE_DIR/mysql
  if ! started_by_us mariadbd; then
    if [[ ! -d $datadir/mysql ]]; then
      mkdir -p "$datadir" && chown mysql:mysql "$datadir"
      mariadb-install-db --no-defaults --user=mysql --datadir="$datadir" --auth-root-authentication-method=socket \
        --skip-test-db >"$LOG_DIR/mariadb-install.log" 2>&1 || die "mariadb-install-db failed ($LOG_DIR/mariadb-install.log)"
    fi
    chown mysql:mysql "$RUN_DIR"
    # A private server: own datadir, socket and port, reachable from 127.0.0.1 only.
    setsid /usr/sbin/mariadbd --no-defaults --user=mysql --datadir="$datadir" --socket="$RUN_DIR/mysqld.sock" \
      --pid-file="$RUN_DIR/mysqld.pid" --bind-address=127.0.0.1 --port="$DB_PORT" --skip-name-resolve \
      --innodb-buffer-pool-size=64M --log-error="$LOG_DIR/mariadb.log" </dev/null >/dev/null 2>&1 &
    echo $! >"$PID_DIR/mariadbd"
    wait_for 60 mariadb db_sql "SELECT 1"
  fi
  # slurmdbd's storage user: loopback-only and without a password, on a database nothing else can reach.
  db_sql "CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1'; GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';"
}

start_slurmdbd() {
  started_by_us slurmdbd && return 0
  /usr/sbin/slurmdbd
  wait_for 30 slurmdbd record_pid "$RUN_DIR/slurmdbd.pid" "$PID_DIR/slurmdbd"
  wait_for 60 "slurmdbd (accounting)" sacctmgr -n list cluster
  sacctmgr -n list cluster format=cluster | grep -qw disttrain || sacctmgr -i add cluster disttrain >/dev/null
}

start_slurmctld() {
  started_by_us slurmctld && return 0
  /usr/sbin/slurmctld
  wait_for 30 slurmctld record_pid "$RUN_DIR/slurmctld.pid" "$PID_DIR/slurmctld"
  wait_for 60 slurmctld scontrol ping
}

start_slurmds() {
  for ((n = 1; n <= NODES; n++)); do
    started_by_us "slurmd-n$n" && continue
    /usr/sbin/slurmd -N "n$n"
    wait_for 30 "slurmd n$n" record_pid "$RUN_DIR/slurmd-n$n.pid" "$PID_DIR/slurmd-n$n"
  done
  nodes_idle() { [[ $(sinfo -h -N -o '%t' | grep -cE '^(idle|mix|alloc)') -eq $NODES ]]; }
  for ((i = 0; i < 240; i++)); do
    nodes_idle && return 0
    # A node left down/drained by a previous session comes back with an explicit resume.
    sinfo -h -N -o '%N %t' | awk '$2 ~ /down|drain/ {print $1}' | while read -r node; do
      scontrol update nodename="$node" state=resume >/dev/null 2>&1 || true
    done
    sleep 0.25
  done
  sinfo -N >&2 || true
  die "the nodes did not become idle within 60s (logs: $LOG_DIR)"
}

start() {
  ((EUID == 0)) || die "needs root (it installs Debian packages and starts daemons)"
  command -v apt-get >/dev/null || die "needs a Debian-like system with apt-get"
  install_packages
  mkdir -p "$PID_DIR" "$LOG_DIR"
  write_configs
  start_munge
  start_database
  start_slurmdbd
  start_slurmctld
  start_slurmds
  say "up: $(sinfo -h -o '%P %D nodes %t' | tr '\n' ' ')(config $ETC/slurm.conf, logs $LOG_DIR)"
}

stop_pid() {  # stop_pid NAME: TERM, then KILL after 15 s, only if the recorded process is alive
  local pid
  pid=$(pid_of "$PID_DIR/$1")
  if alive "$pid"; then
    kill -TERM "$pid" 2>/dev/null || true
    for ((i = 0; i < 60; i++)); do alive "$pid" || break; sleep 0.25; done
    alive "$pid" && kill -KILL "$pid" 2>/dev/null || true
  fi
  rm -f "$PID_DIR/$1"
}

stop() {
  [[ -d $PID_DIR ]] || { say "nothing to stop"; return 0; }
  if started_by_us slurmctld; then
    # Every job in this cluster was submitted to it: cancel them so no slurmstepd outlives its slurmd.
    local jobs
    jobs=$(squeue -h -o %i 2>/dev/null | tr '\n' ' ')
    # shellcheck disable=SC2086  # one argument per job id
    [[ -n ${jobs// /} ]] && scancel $jobs >/dev/null 2>&1 || true
    for ((i = 0; i < 40; i++)); do [[ -z $(squeue -h -o %i 2>/dev/null) ]] && break; sleep 0.25; done
  fi
  for ((n = NODES; n >= 1; n--)); do stop_pid "slurmd-n$n"; done
  for name in "$PID_DIR"/slurmd-*; do [[ -e $name ]] && stop_pid "$(basename "$name")"; done
  stop_pid slurmctld
  stop_pid slurmdbd
  stop_pid mariadbd
  stop_pid munged
  say "stopped"
}

status() {
  for f in "$PID_DIR"/*; do
    [[ -e $f ]] || continue
    if alive "$(pid_of "$f")"; then echo "$(basename "$f") pid $(pid_of "$f") (started by this script)"; fi
  done
  sinfo 2>/dev/null || say "slurmctld is not answering"
}

case "${1:-}" in
  start) start ;;
  stop) stop ;;
  status) status ;;
  *) echo "usage: $0 start|stop|status" >&2; exit 2 ;;
esac
