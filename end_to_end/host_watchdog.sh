#!/usr/bin/env bash
# Runs a command and kills it when its host memory passes a limit, so that the run ends with its log
# instead of the machine's out-of-memory kill (which, on a lent machine, can take the logs with it).
#
#   bash end_to_end/host_watchdog.sh LIMIT_GIB COMMAND [ARGS...]
#
# Every 0.2 s it reads the machine's memory in use (MemTotal - MemAvailable: tmpfs files and other
# processes count too) and, where readable, the cgroup's memory.current; the larger is compared with
# LIMIT_GIB. The resident size (RSS) of the command's processes is printed, not compared: on a TPU VM
# it counts the chip's memory mapped into the process (measured: +8.9 GiB of RSS at the runtime's
# start for +4.7 GiB of host memory), so it overstates what the host holds. Past it, it prints the largest processes and kills the group (SIGKILL). It prints
# the peak at the end. Exit status: the command's (137 when killed here).
set -uo pipefail
[ $# -ge 2 ] || { echo "usage: $0 LIMIT_GIB COMMAND [ARGS...]" >&2; exit 2; }
limit_kib=$(awk -v g="$1" 'BEGIN { printf "%d", g * 1048576 }'); shift
cgroup=/sys/fs/cgroup/memory.current
gib() { awk -v k="$1" 'BEGIN { printf "%.1f", k / 1048576 }'; }
echo "host watchdog: limit $(gib "$limit_kib") GiB; $(grep -E 'MemTotal|MemAvailable' /proc/meminfo | tr -s ' ' | tr '\n' ';')" \
     "cgroup max $(cat /sys/fs/cgroup/memory.max 2>/dev/null || echo unreadable)"
setsid "$@" &
pid=$!
peak=0
while kill -0 "$pid" 2>/dev/null; do
  used=$(awk '/^MemTotal/ { t = $2 } /^MemAvailable/ { a = $2 } END { print t - a }' /proc/meminfo)
  if [ -r "$cgroup" ]; then
    charged=$(( $(cat "$cgroup") / 1024 ))
    [ "$charged" -gt "$used" ] && used=$charged
  fi
  [ "$used" -gt "$peak" ] && peak=$used
  if [ "$used" -gt "$limit_kib" ]; then
    echo "host watchdog: $(gib "$used") GiB in use passed the limit $(gib "$limit_kib") GiB; killing the command" >&2
    ps -eo rss=,args= --sort=-rss | head -5 | awk '{ printf "  RSS %.1f GiB %s\n", $1 / 1048576, substr($0, index($0, $2)) }' >&2
    kill -9 -- "-$pid" 2>/dev/null
    break
  fi
  sleep 0.2
done
wait "$pid"
status=$?
echo "host watchdog: peak $(gib "$peak") GiB in use (exit $status)"
exit "$status"
