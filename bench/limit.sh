#!/usr/bin/env bash
# bash bench/limit.sh SECONDS GRACE COMMAND...: run COMMAND (one bash command line); after SECONDS, send
# SIGTERM to the workers of each torchrun it started, so that the train scripts finish the step in
# progress, checkpoint it and exit (sharding.StopRequest), and torchrun exits with them; GRACE seconds
# later, kill whatever is left. Signalling torchrun as well, as `timeout` does, would start its own
# clock: it kills its workers 30 s later, and torch before 2.12 has no way to lengthen that (a step and
# a checkpoint of the 0.5B model on one H200 took 29 s of it). A command that started no torchrun, and a
# torchrun that has not started its workers yet, get the SIGTERM themselves. Exit status: the command's.
set -u
limit=$1 grace=$2
shift 2
setsid bash -c "$*" &  # its own session: everything it starts can be found, and killed, by session id
pid=$!
(
  trap 'kill "$sleeper" 2>/dev/null; exit 0' TERM  # the command ended first: no signal, no stray sleep
  sleep "$limit" & sleeper=$!
  wait "$sleeper"
  # a limit reached before the command has made its session (a limit of 0, a loaded machine) would signal
  # no one, and the command would run on to the grace period's end: wait for the session first
  while [ "$(ps -o sid= -p "$pid" | tr -d ' ')" != "$pid" ] && kill -0 "$pid" 2>/dev/null; do sleep 0.05; done
  # torchrun's own processes; not a shell whose command line names it (`bash -c "a && torchrun ..."`
  # stays the parent of what it runs, and signalling its children would signal torchrun)
  launchers=$(for p in $(pgrep -s "$pid" -f torch.distributed.run); do
    case $(ps -o comm= -p "$p") in sh|bash|dash|zsh) ;; *) echo "$p" ;; esac
  done)
  workers=""
  if [ -n "$launchers" ]; then
    for launcher in $launchers; do
      # a worker between torchrun's fork and its exec still has torchrun's command line and signal
      # handling, which would lose the signal: wait (at most 10 s) for it to run the script
      for _ in $(seq 200); do pgrep -P "$launcher" -f torch.distributed.run > /dev/null || break; sleep 0.05; done
      mine=$(pgrep -P "$launcher")
      # a torchrun that has not started its workers yet has nothing to checkpoint: it gets the signal
      if [ -n "$mine" ]; then kill -TERM $mine; else kill -TERM "$launcher"; fi
      workers="$workers $mine"
    done
  else
    pkill -TERM -s "$pid"
  fi
  sleep "$grace" & sleeper=$!
  wait "$sleeper"
  # torchrun starts each worker in a session of its own: those sessions, then the command's
  for worker in $workers; do pkill -KILL -s "$worker"; done
  pkill -KILL -s "$pid"
) &
watchdog=$!
wait "$pid"
status=$?
kill "$watchdog" 2>/dev/null
exit "$status"
