#!/usr/bin/env bash
# gpuguard testbed: a real two-node Slurm 22.05 cluster (munged, MariaDB, slurmdbd,
# slurmctld, 2x slurmd) on this one host, with fake GPU character devices.
#
#   testbed.sh up       install missing packages, (re)start everything, wait for idle nodes
#   testbed.sh down     stop the daemons this testbed started (by pid file)
#   testbed.sh status   daemon states + sinfo; exit 0 when everything is up
#   testbed.sh env      print `export SLURM_CONF=...` for use with eval
#
# Environment:
#   TESTBED                  state directory                  [/tmp/gpuguard-testbed]
#   GPUGUARD_VENV            venv holding the hook scripts    [<repo>/.venv]
#   GPUGUARD_TESTBED_TOML    file copied to $TESTBED/etc/gpuguard.toml (else a placeholder)
#   TESTBED_PROLOG / TESTBED_EPILOG / TESTBED_TASKPROLOG / TESTBED_EPILOG_SLURMCTLD
#                            override a hook path (default: the venv's gpuguard-* script;
#                            the empty string leaves that hook out of slurm.conf)
#   TESTBED_PROCTRACK        cgroup | linuxproc               [auto: cgroup if v1 freezer works]
#   TESTBED_PORT_BASE        ports BASE+6 mariadb, +7 slurmctld, +9 slurmdbd, +21.. slurmd [16810]
#   TESTBED_FRESH=1          `up` restarts from scratch even when everything is already up
#   TESTBED_WAIT_S           bound for each readiness wait     [60]
#   TESTBED_ETC_LINKS=0      do not create the symlinks /etc/slurm/slurm.conf and
#                            /etc/gpuguard/gpuguard.toml into $TESTBED/etc [1]. PrologSlurmctld
#                            and EpilogSlurmctld get NO SLURM_CONF: only these default paths lead
#                            their scontrol/sacctmgr and gpuguard's config lookup to the testbed.
#                            Made only where no real file exists; `down` removes them.
#
# `up` is idempotent: when every daemon is running, the nodes answer and the generated
# config equals the running one, it only refreshes gpuguard.toml. Otherwise it stops what
# is left and starts from scratch: StateSaveLocation, the accounting DB and the job output
# are wiped together (job ids restart at 1).
set -euo pipefail

TESTBED=${TESTBED:-/tmp/gpuguard-testbed}
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
GPUGUARD_VENV=${GPUGUARD_VENV:-$REPO/.venv}
PORT_BASE=${TESTBED_PORT_BASE:-16810}
WAIT_S=${TESTBED_WAIT_S:-60}
CLUSTER=gpuguardtb
NODES=(n1 n2)
GPUS_PER_NODE=4
TEST_USERS=(gg_alice gg_bob gg_carol)
DB_NAME=slurm_acct_db
DB_PASS=gpuguard-testbed

ETC=$TESTBED/etc
RUN=$TESTBED/run          # pid files of the slurm daemons (owned by slurm)
LOG=$TESTBED/log          # slurm + mariadb logs (owned by slurm); also the Prolog/Epilog cwd
MUNGE_DIR=$TESTBED/munge  # munged socket, pid, log, seed (owned by munge)
MYSQL_DIR=$TESTBED/mysql  # MariaDB datadir (owned by mysql)
MYSQL_RUN=$TESTBED/mysql-run
MYSQL_SOCK=$MYSQL_RUN/mysqld.sock
MUNGE_SOCK=$MUNGE_DIR/munge.socket
STATE=$TESTBED/state
SPOOL=$TESTBED/spool
JOBS=$TESTBED/jobs
DEV=$TESTBED/dev

export SLURM_CONF=$ETC/slurm.conf
export PATH=/usr/sbin:/usr/bin:/sbin:/bin:$PATH

log() { printf '[testbed %(%H:%M:%S)T] %s\n' -1 "$*" >&2; }
die() { printf '[testbed] ERROR: %s\n' "$*" >&2; exit 1; }
now_ms() { date +%s%3N; }

# ---------------------------------------------------------------- processes / pid files
# pidfile name -> expected /proc/PID/comm
declare -A COMM=(
  [munged]=munged [mariadb]=mariadbd [slurmdbd]=slurmdbd [slurmctld]=slurmctld
  [slurmd-n1]=slurmd [slurmd-n2]=slurmd
)
DAEMONS=(munged mariadb slurmdbd slurmctld slurmd-n1 slurmd-n2)

pidfile_of() {
  case $1 in
    munged) echo "$MUNGE_DIR/munged.pid" ;;
    mariadb) echo "$MYSQL_RUN/mariadbd.pid" ;;
    *) echo "$RUN/$1.pid" ;;   # exact names: slurmd-n1.pid never globbed (would hit slurmdbd.pid)
  esac
}

# pid of a live (non-zombie) process with the right comm, or nothing
live_pid() {
  local name=$1 f pid comm state
  f=$(pidfile_of "$name")
  [[ -r $f ]] || return 1
  pid=$({ tr -dc '0-9' <"$f"; } 2>/dev/null) || return 1
  [[ -n $pid ]] || return 1
  comm=$(cat "/proc/$pid/comm" 2>/dev/null) || return 1
  [[ $comm == "${COMM[$name]}" ]] || return 1
  # field 3 of /proc/PID/stat is the state; comm (field 2) has no spaces here
  state=$(awk '{print $3}' "/proc/$pid/stat" 2>/dev/null) || return 1
  [[ $state != Z && $state != X ]] || return 1
  echo "$pid"
}

is_running() { live_pid "$1" >/dev/null; }

show_logs() {  # tails of the given logs, without the harmless mpi/pmix noise
  local f
  for f in "$@"; do
    [[ -r $f ]] || continue
    printf -- '----- last 30 lines of %s (mpi/pmix noise removed) -----\n' "$f" >&2
    grep -v -e 'pmix' -e 'MPI: Cannot create context' "$f" | tail -n 30 >&2 || true
  done
}

# wait_for DESCRIPTION "LOG..." CMD...   (bounded; prints the log tails on failure)
# Fails at once when a daemon named in $WAIT_ALIVE (space-separated) has died.
wait_for() {
  local what=$1 logf=$2; shift 2
  local deadline=$(( $(date +%s) + WAIT_S )) d grace=$(( $(now_ms) + 1500 ))
  until "$@" >/dev/null 2>&1; do
    # grace period: a daemon that just forked may not have written its pid file yet
    (( $(now_ms) > grace )) && for d in ${WAIT_ALIVE:-}; do
      if ! is_running "$d"; then
        printf '[testbed] ERROR: %s died while waiting for %s\n' "$d" "$what" >&2
        show_logs $logf
        exit 1
      fi
    done
    if (( $(date +%s) >= deadline )); then
      printf '[testbed] ERROR: timed out after %ss waiting for %s\n' "$WAIT_S" "$what" >&2
      show_logs $logf
      exit 1
    fi
    sleep 0.1
  done
}

stop_daemon() {
  local name=$1 pid i
  if ! pid=$(live_pid "$name"); then
    rm -f "$(pidfile_of "$name")"
    return 0
  fi
  kill -TERM "$pid" 2>/dev/null || true
  for ((i = 0; i < 150; i++)); do          # 15 s
    is_running "$name" || break
    sleep 0.1
  done
  if is_running "$name"; then
    log "$name (pid $pid) ignored SIGTERM for 15 s, sending SIGKILL"
    kill -KILL "$pid" 2>/dev/null || true
    for ((i = 0; i < 50; i++)); do is_running "$name" || break; sleep 0.1; done
  fi
  rm -f "$(pidfile_of "$name")"
  log "stopped $name"
}

# ---------------------------------------------------------------- install / users
install_packages() {
  local missing=() p
  for p in slurm-wlm slurmdbd munge mariadb-server slurm-client; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
  done
  if ((${#missing[@]})); then
    log "installing ${missing[*]}"
    apt-get update -q >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null
  fi
}

ensure_users() {
  local u
  for u in "${TEST_USERS[@]}"; do
    id -u "$u" >/dev/null 2>&1 || useradd -m -s /bin/bash "$u"
  done
}

# The hooks run as root (Prolog/Epilog), as SlurmUser (EpilogSlurmctld) and as the job
# user (TaskProlog). The venv's python is a symlink into the interpreter's prefix
# (here /root/.pyenv/..., and /root is 0700), so non-root users cannot exec it.
# Grant search (x) permission with a per-user ACL on exactly the directories that block
# it; nothing gets read permission and nothing else changes.
ensure_hooks_executable() {
  local users=(slurm "${TEST_USERS[@]}") u p d paths=()
  local py=$GPUGUARD_VENV/bin/python3
  [[ -x $py ]] || { log "WARNING: $py not found; hooks will fail"; return 0; }
  paths=("$(readlink -f "$py")" "$GPUGUARD_VENV/bin/x" "$REPO/x")
  for u in "${users[@]}"; do
    runuser -u "$u" -- "$py" -c 'import gpuguard' >/dev/null 2>&1 && continue
    if ! command -v setfacl >/dev/null; then
      DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends acl >/dev/null \
        || { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends acl >/dev/null; }
    fi
    for p in "${paths[@]}"; do
      # walk from / downwards so that only the directories that really block get an ACL
      local chain=() d=$(dirname "$p")
      while [[ $d != / ]]; do chain=("$d" "${chain[@]}"); d=$(dirname "$d"); done
      for d in "${chain[@]}"; do
        if ! runuser -u "$u" -- test -x "$d" 2>/dev/null; then
          setfacl -m "u:$u:--x" "$d"
          log "granted search permission on $d to $u (ACL u:$u:--x)"
        fi
      done
    done
    runuser -u "$u" -- "$py" -c 'import gpuguard' >/dev/null 2>&1 \
      || log "WARNING: user $u still cannot run $py -c 'import gpuguard'"
  done
}

# ---------------------------------------------------------------- config
pick_proctrack() {
  if [[ -n ${TESTBED_PROCTRACK:-} ]]; then echo "$TESTBED_PROCTRACK"; return; fi
  local probe=/sys/fs/cgroup/freezer/gpuguard_testbed_probe.$$
  if [[ -d /sys/fs/cgroup/freezer ]] && mkdir "$probe" 2>/dev/null; then
    rmdir "$probe"
    echo cgroup
  else
    echo linuxproc
  fi
}

hook_line() {  # hook_line Key ENVVAR default
  local key=$1 var=$2 def=$3
  if [[ -n ${!var+x} ]]; then
    [[ -n ${!var} ]] && echo "$key=${!var}"
  else
    echo "$key=$def"
  fi
  return 0
}

# write slurm.conf, gres.conf, cgroup.conf, slurmdbd.conf, plugstack.conf into dir $1
gen_config() {
  local out=$1 host cpus proctrack i n first last port
  host=$(hostname -s)
  cpus=$(nproc)
  proctrack=$(pick_proctrack)
  mkdir -p "$out"
  {
    echo "# generated by tests/testbed/testbed.sh -- do not edit, rerun 'testbed.sh up'"
    echo "ClusterName=$CLUSTER"
    echo "SlurmctldHost=$host(127.0.0.1)"
    echo "SlurmUser=slurm"
    echo "SlurmctldPort=$((PORT_BASE + 7))"
    echo "AuthType=auth/munge"
    echo "AuthInfo=socket=$MUNGE_SOCK"
    echo "StateSaveLocation=$STATE"
    echo "SlurmdSpoolDir=$SPOOL/%n"
    echo "SlurmctldPidFile=$RUN/slurmctld.pid"
    echo "SlurmdPidFile=$RUN/slurmd-%n.pid"
    echo "SlurmctldLogFile=$LOG/slurmctld.log"
    echo "SlurmdLogFile=$LOG/slurmd-%n.log"
    echo "SlurmctldDebug=info"
    echo "SlurmdDebug=info"
    echo "PlugStackConfig=$ETC/plugstack.conf"
    echo "MpiDefault=none"
    if [[ $proctrack == cgroup ]]; then
      echo "ProctrackType=proctrack/cgroup"
      echo "TaskPlugin=task/cgroup,task/affinity"
    else
      echo "ProctrackType=proctrack/linuxproc"
      echo "TaskPlugin=task/affinity"
    fi
    echo "SelectType=select/cons_tres"
    echo "SelectTypeParameters=CR_Core"
    echo "GresTypes=gpu"
    echo "AccountingStorageType=accounting_storage/slurmdbd"
    echo "AccountingStorageHost=127.0.0.1"
    echo "AccountingStoragePort=$((PORT_BASE + 9))"
    echo "AccountingStoragePass=$MUNGE_SOCK"   # munge socket for slurmdbd traffic (sacctmgr!)
    echo "AccountingStorageTRES=gres/gpu"
    echo "AccountingStoreFlags=job_comment"
    echo "AccountingStorageEnforce=associations"
    echo "JobAcctGatherType=jobacct_gather/linux"
    echo "JobCompType=jobcomp/none"
    echo "PrologFlags=Alloc,Contain"
    hook_line Prolog TESTBED_PROLOG "$GPUGUARD_VENV/bin/gpuguard-prolog"
    hook_line Epilog TESTBED_EPILOG "$GPUGUARD_VENV/bin/gpuguard-epilog"
    hook_line TaskProlog TESTBED_TASKPROLOG "$GPUGUARD_VENV/bin/gpuguard-taskprolog"
    hook_line EpilogSlurmctld TESTBED_EPILOG_SLURMCTLD "$GPUGUARD_VENV/bin/gpuguard-epilog-slurmctld"
    # HealthCheckProgram: a wrapper that runs gpuguard-health only while
    # $ETC/healthcheck.on exists (tests switch it on), so other tests' kernel-log XIDs are
    # left to the Prolog; TESTBED_HEALTHCHECK="" leaves it out.
    hook_line HealthCheckProgram TESTBED_HEALTHCHECK "$ETC/healthcheck.sh"
    if [[ -n ${TESTBED_HEALTHCHECK-x} ]]; then
      echo "HealthCheckInterval=${TESTBED_HEALTHCHECK_INTERVAL:-5}"
      echo "HealthCheckNodeState=ANY"
    fi
    echo "PrologEpilogTimeout=60"
    echo "SchedulerParameters=batch_sched_delay=0"
    echo "KillWait=5"
    echo "MailProg=/bin/true"
    echo "ReturnToService=2"
    # users see only their own jobs (squeue/scontrol here, sacct through slurmdbd.conf):
    # gpuguard job show leaves who may see a job to Slurm
    echo "PrivateData=jobs"
    for i in "${!NODES[@]}"; do
      n=${NODES[$i]}
      port=$((PORT_BASE + 21 + i))
      echo "NodeName=$n NodeHostname=$host NodeAddr=127.0.0.1 Port=$port CPUs=$cpus Gres=gpu:$GPUS_PER_NODE State=UNKNOWN"
    done
    # OverSubscribe=FORCE:4: jobs may share the 2 vCPUs, so four single-GPU jobs run on one
    # node at the same time (GPUs, as GRES, are never shared).
    echo "PartitionName=gpu Nodes=$(IFS=,; echo "${NODES[*]}") Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4"
  } >"$out/slurm.conf"
  printf '%s\n' "#!/bin/sh" \
    "# testbed HealthCheckProgram (generated): gpuguard-health while $ETC/healthcheck.on exists" \
    "[ -e $ETC/healthcheck.on ] || exit 0" \
    "SLURM_CONF=$ETC/slurm.conf GPUGUARD_CONFIG=$ETC/gpuguard.toml exec $GPUGUARD_VENV/bin/gpuguard-health" >"$out/healthcheck.sh"
  chmod 0755 "$out/healthcheck.sh"
  {
    echo "# generated by tests/testbed/testbed.sh; minor numbers are distinct across nodes"
    for i in "${!NODES[@]}"; do
      first=$((i * GPUS_PER_NODE)); last=$((first + GPUS_PER_NODE - 1))
      echo "NodeName=${NODES[$i]} Name=gpu File=$DEV/nvidia[$first-$last]"
    done
  } >"$out/gres.conf"
  if [[ $proctrack == cgroup ]]; then
    printf '%s\n' "CgroupPlugin=cgroup/v1" "CgroupMountpoint=/sys/fs/cgroup" \
      "ConstrainCores=yes" "ConstrainDevices=yes" >"$out/cgroup.conf"
  else
    printf '%s\n' "# proctrack/linuxproc: no cgroup constraints" "CgroupPlugin=cgroup/v1" >"$out/cgroup.conf"
  fi
  : >"$out/plugstack.conf"
  printf '%s\n' \
    "AuthType=auth/munge" "AuthInfo=socket=$MUNGE_SOCK" \
    "DbdAddr=127.0.0.1" "DbdHost=$host" "DbdPort=$((PORT_BASE + 9))" \
    "SlurmUser=slurm" "DebugLevel=info" \
    "LogFile=$LOG/slurmdbd.log" "PidFile=$RUN/slurmdbd.pid" \
    "StorageType=accounting_storage/mysql" "StorageHost=127.0.0.1" \
    "StoragePort=$((PORT_BASE + 6))" "StorageUser=slurm" "StoragePass=$DB_PASS" \
    "StorageLoc=$DB_NAME" "PrivateData=jobs" >"$out/slurmdbd.conf"
}

write_gpuguard_toml() {
  if [[ -n ${GPUGUARD_TESTBED_TOML:-} ]]; then
    [[ -r $GPUGUARD_TESTBED_TOML ]] || die "GPUGUARD_TESTBED_TOML=$GPUGUARD_TESTBED_TOML is not readable"
    install -m 0644 "$GPUGUARD_TESTBED_TOML" "$ETC/gpuguard.toml"
  else
    cat >"$ETC/gpuguard.toml" <<EOF
# gpuguard config for the testbed (placeholder written by tests/testbed/testbed.sh).
# The hooks find this file at dirname(\$SLURM_CONF)/gpuguard.toml.
# Keys are defined by the Python side; set GPUGUARD_TESTBED_TOML=/path/to/file.toml
# before 'testbed.sh up' to install a real one here.
# testbed: TESTBED=$TESTBED  cluster=$CLUSTER  nodes=${NODES[*]}  gpus/node=$GPUS_PER_NODE
EOF
    chmod 0644 "$ETC/gpuguard.toml"
  fi
}

config_matches() {  # generated config == installed config?
  local tmp f rc=0
  tmp=$(mktemp -d)
  gen_config "$tmp"
  for f in slurm.conf gres.conf cgroup.conf slurmdbd.conf plugstack.conf healthcheck.sh; do
    cmp -s "$tmp/$f" "$ETC/$f" || { rc=1; break; }
  done
  rm -rf "$tmp"
  return $rc
}

# ---------------------------------------------------------------- start steps
make_dirs() {
  install -d -m 0755 "$TESTBED" "$ETC" "$DEV"
  install -d -m 0755 -o slurm -g slurm "$RUN" "$LOG" "$STATE" "$SPOOL"
  install -d -m 1777 "$JOBS"
  install -d -m 0700 -o munge -g munge "$MUNGE_DIR"
  chmod 0755 "$MUNGE_DIR"       # clients (any user) must reach the socket
  install -d -m 0750 -o mysql -g mysql "$MYSQL_DIR"
  install -d -m 0755 -o mysql -g mysql "$MYSQL_RUN"
  local i k
  for i in "${!NODES[@]}"; do
    install -d -m 0755 "$SPOOL/${NODES[$i]}"
    for ((k = i * GPUS_PER_NODE; k < (i + 1) * GPUS_PER_NODE; k++)); do
      if [[ ! -c $DEV/nvidia$k ]]; then
        rm -f "$DEV/nvidia$k"
        mknod -m 0666 "$DEV/nvidia$k" c 195 "$k"
      fi
    done
  done
}

wipe_state() {
  find "$STATE" -mindepth 1 -delete
  find "$SPOOL" -mindepth 2 -delete 2>/dev/null || true
  find "$JOBS" -mindepth 1 -delete
  rm -f "$LOG"/*.log "$MUNGE_DIR/munged.log"
}

start_munged() {
  [[ -r /etc/munge/munge.key ]] || runuser -u munge -- mungekey --create --keyfile=/etc/munge/munge.key
  runuser -u munge -- /usr/sbin/munged --socket="$MUNGE_SOCK" --pid-file="$MUNGE_DIR/munged.pid" \
    --log-file="$MUNGE_DIR/munged.log" --seed-file="$MUNGE_DIR/munged.seed" \
    --key-file=/etc/munge/munge.key
  wait_for munged "$MUNGE_DIR/munged.log" bash -c \
    "munge -n --socket='$MUNGE_SOCK' | unmunge --socket='$MUNGE_SOCK'"
}

mysql_root() { mariadb --no-defaults -S "$MYSQL_SOCK" -u root "$@"; }

start_mariadb() {
  if [[ ! -d $MYSQL_DIR/mysql ]]; then
    log "initialising MariaDB datadir $MYSQL_DIR"
    mariadb-install-db --no-defaults --user=mysql --datadir="$MYSQL_DIR" \
      --auth-root-authentication-method=socket --skip-test-db >"$LOG/mariadb-install.log" 2>&1 \
      || { tail -n 30 "$LOG/mariadb-install.log" >&2; die "mariadb-install-db failed"; }
  fi
  setsid /usr/sbin/mariadbd --no-defaults --user=mysql --datadir="$MYSQL_DIR" \
    --socket="$MYSQL_SOCK" --pid-file="$MYSQL_RUN/mariadbd.pid" \
    --port=$((PORT_BASE + 6)) --bind-address=127.0.0.1 \
    --innodb-buffer-pool-size=128M --innodb-lock-wait-timeout=900 \
    >>"$LOG/mariadb.log" 2>&1 </dev/null &
  wait_for "MariaDB (mariadb-admin ping)" "$LOG/mariadb.log" \
    mariadb-admin --no-defaults -S "$MYSQL_SOCK" -u root ping
  wait_for "MariaDB pid file" "$LOG/mariadb.log" is_running mariadb
  mysql_root <<EOF
DROP DATABASE IF EXISTS $DB_NAME;
CREATE USER IF NOT EXISTS 'slurm'@'localhost' IDENTIFIED BY '$DB_PASS';
CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1' IDENTIFIED BY '$DB_PASS';
GRANT ALL ON $DB_NAME.* TO 'slurm'@'localhost';
GRANT ALL ON $DB_NAME.* TO 'slurm'@'127.0.0.1';
FLUSH PRIVILEGES;
EOF
}

start_slurmdbd() {
  chown slurm:slurm "$ETC/slurmdbd.conf"
  chmod 0600 "$ETC/slurmdbd.conf"
  # slurmdbd has no -f: it reads dirname($SLURM_CONF)/slurmdbd.conf
  /usr/sbin/slurmdbd \
    || die "slurmdbd failed to start: $(tail -n 20 "$LOG/slurmdbd.log" 2>/dev/null)"
  WAIT_ALIVE=slurmdbd wait_for "slurmdbd (sacctmgr show cluster)" "$LOG/slurmdbd.log" sacctmgr -n show cluster
}

setup_accounting() {
  sacctmgr -i add cluster "$CLUSTER" >/dev/null
  sacctmgr -i add account acct_a,acct_b,acct_c Cluster="$CLUSTER" Description=gpuguard-test Organization=gpuguard >/dev/null
  sacctmgr -i add user gg_alice Account=acct_a DefaultAccount=acct_a Cluster="$CLUSTER" >/dev/null
  sacctmgr -i add user gg_alice Account=acct_b Cluster="$CLUSTER" >/dev/null
  sacctmgr -i add user gg_bob Account=acct_b DefaultAccount=acct_b Cluster="$CLUSTER" >/dev/null
  sacctmgr -i add user gg_carol Account=acct_c DefaultAccount=acct_c Cluster="$CLUSTER" >/dev/null
}

nodes_idle() {
  local out
  out=$(sinfo -h -N -o '%N %T' 2>/dev/null) || return 1
  [[ $(grep -c ' idle$' <<<"$out") -eq ${#NODES[@]} ]]
}

start_slurm() {
  /usr/sbin/slurmctld -f "$SLURM_CONF" || die "slurmctld failed to start: $(tail -n 20 "$LOG/slurmctld.log" 2>/dev/null)"
  WAIT_ALIVE=slurmctld wait_for "slurmctld (scontrol ping)" "$LOG/slurmctld.log" bash -c 'scontrol ping | grep -q UP'
  local n
  for n in "${NODES[@]}"; do
    /usr/sbin/slurmd -N "$n" -f "$SLURM_CONF" || die "slurmd -N $n failed: $(tail -n 20 "$LOG/slurmd-$n.log" 2>/dev/null)"
  done
  WAIT_ALIVE="slurmctld slurmd-n1 slurmd-n2" \
    wait_for "both nodes idle (sinfo)" "$LOG/slurmctld.log $LOG/slurmd-n1.log $LOG/slurmd-n2.log" nodes_idle
}

ETC_LINKS=(/etc/slurm/slurm.conf /etc/gpuguard/gpuguard.toml)

make_etc_links() {
  [[ ${TESTBED_ETC_LINKS:-1} == 1 ]] || return 0
  local l
  for l in "${ETC_LINKS[@]}"; do
    mkdir -p "$(dirname "$l")"
    if [[ -L $l ]]; then
      ln -sfn "$ETC/$(basename "$l")" "$l"
    elif [[ -e $l ]]; then
      log "WARNING: $l exists and is not a testbed link; leaving it (EpilogSlurmctld will read it)"
    else
      ln -s "$ETC/$(basename "$l")" "$l"
    fi
  done
}

remove_etc_links() {
  local l
  for l in "${ETC_LINKS[@]}"; do
    [[ -L $l && $(readlink "$l") == "$ETC/"* ]] && rm -f "$l"
  done
  rmdir /etc/gpuguard 2>/dev/null || true   # only if empty (up created it)
  return 0
}

# ---------------------------------------------------------------- commands
all_running() {
  local d
  for d in "${DAEMONS[@]}"; do is_running "$d" || return 1; done
}

cmd_down() {
  local d i jobs
  if is_running slurmctld; then
    jobs=$(squeue -h -o %i 2>/dev/null || true)
    if [[ -n $jobs ]]; then
      log "cancelling leftover jobs: $(tr '\n' ' ' <<<"$jobs")"
      scancel $jobs 2>/dev/null || true
      for ((i = 0; i < 100; i++)); do
        [[ -z $(squeue -h -o %i 2>/dev/null) ]] && break
        sleep 0.1
      done
    fi
  fi
  for ((i = ${#DAEMONS[@]} - 1; i >= 0; i--)); do
    stop_daemon "${DAEMONS[$i]}"
  done
  remove_etc_links
}

cmd_status() {
  local d rc=0 pid
  for d in "${DAEMONS[@]}"; do
    if pid=$(live_pid "$d"); then
      printf '%-10s running (pid %s)\n' "$d" "$pid"
    else
      printf '%-10s stopped\n' "$d"
      rc=1
    fi
  done
  if is_running slurmctld && [[ -r $SLURM_CONF ]]; then
    sinfo -N -o '%N %T %E' || rc=1
  else
    echo "(slurmctld not running: no sinfo)"
  fi
  return $rc
}

cmd_up() {
  local t0 t1 d
  t0=$(now_ms)
  [[ $(id -u) -eq 0 ]] || die "must run as root"
  install_packages
  ensure_users
  ensure_hooks_executable
  make_dirs
  write_gpuguard_toml
  make_etc_links
  if [[ ${TESTBED_FRESH:-0} != 1 ]] && all_running && config_matches \
      && sinfo -h -N -o '%T' 2>/dev/null | grep -qv -e '\*$' -e '^down'; then
    log "already up (gpuguard.toml refreshed); TESTBED_FRESH=1 forces a restart"
    return 0
  fi
  cmd_down
  make_etc_links
  gen_config "$ETC"
  wipe_state
  t1=$(now_ms)
  log "starting daemons (prep took $(( t1 - t0 )) ms)"
  local step ts=$t1 timings=""
  for step in start_munged start_mariadb start_slurmdbd setup_accounting start_slurm; do
    "$step"
    timings+=" ${step#start_}=$(( $(now_ms) - ts ))ms"
    ts=$(now_ms)
  done
  log "step timings:$timings"
  log "testbed up: daemons $(( $(now_ms) - t1 )) ms, total $(( $(now_ms) - t0 )) ms; export SLURM_CONF=$SLURM_CONF"
}

usage() { echo "usage: $0 up|down|status|env" >&2; exit 2; }

case ${1:-} in
  up) cmd_up ;;
  down) [[ $(id -u) -eq 0 ]] || die "must run as root"; cmd_down ;;
  status) cmd_status ;;
  env) echo "export SLURM_CONF=$SLURM_CONF TESTBED=$TESTBED" ;;
  *) usage ;;
esac
