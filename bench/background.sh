#!/usr/bin/env bash
# A command that outlives the call that started it, on a machine that stays up between calls of limited
# length (the GPU machine: 10 minutes a call), followed by its name and not by its command line:
#   bash bench/background.sh start NAME COMMAND...  # run COMMAND (one bash command line) in its own session
#   bash bench/background.sh wait NAME SECONDS      # until it ends or SECONDS pass; exit 0 once it has ended
#   bash bench/background.sh stop NAME [GRACE]      # abandon it: SIGTERM to its whole session, SIGKILL GRACE
#                                                   # (default 30) s later (a run that should checkpoint on
#                                                   # its way out stops by its own LIMIT: bench/limit.sh)
# Its output goes to $BG_DIR/NAME.log (BG_DIR default /tmp/bg), its exit status to NAME.rc when it ends.
# `wait` prints the status, or how long it has run. Finding a run by `pgrep -f` instead would also find
# the shell of the call asking, whose own command line names what it looks for.
set -u
dir=${BG_DIR:-/tmp/bg}
usage="usage: bash bench/background.sh start NAME COMMAND... | wait NAME SECONDS | stop NAME [GRACE]"
[ $# -ge 2 ] || { echo "$usage" >&2; exit 2; }
action=$1 name=$2
shift 2
pidfile=$dir/$name.pid rcfile=$dir/$name.rc log=$dir/$name.log
running() { [ -f "$pidfile" ] && kill -0 "$(cat "$pidfile")" 2>/dev/null; }
case $action in
  start)
    [ $# -ge 1 ] || { echo "$usage" >&2; exit 2; }
    mkdir -p "$dir"
    if running; then echo "$name is already running (pid $(cat "$pidfile")); stop it first" >&2; exit 1; fi
    rm -f "$rcfile"
    # setsid: a session of its own, which the end of the calling command does not take down, and which
    # `stop` signals whole. The status is written by the session's shell once the command returns
    setsid nohup bash -c 'bash -c "$1"; echo $? > "$2"' _ "$*" "$rcfile" > "$log" 2>&1 < /dev/null &
    echo $! > "$pidfile"
    echo "$name started (pid $!), output in $log"
    ;;
  wait)
    [ $# -eq 1 ] && [[ $1 =~ ^[0-9]+$ ]] || { echo "$usage" >&2; exit 2; }
    [ -f "$pidfile" ] || { echo "no run named $name in $dir" >&2; exit 2; }
    end=$((SECONDS + $1))
    while running && [ $SECONDS -lt $end ]; do sleep 2; done
    if running; then
      echo "$name still running after $(ps -o etimes= -p "$(cat "$pidfile")" | tr -d ' ') s"
      exit 1
    fi
    echo "$name ended with status $(cat "$rcfile" 2>/dev/null || echo '? (killed)')"
    ;;
  stop)
    grace=${1:-30}
    [ -f "$pidfile" ] || { echo "no run named $name in $dir" >&2; exit 2; }
    pid=$(cat "$pidfile")
    if running; then
      pkill -TERM -s "$pid"
      end=$((SECONDS + grace))
      while running && [ $SECONDS -lt $end ]; do sleep 1; done
      pkill -KILL -s "$pid" 2>/dev/null
    fi
    echo "$name stopped"
    ;;
  *) echo "$usage" >&2; exit 2 ;;
esac
