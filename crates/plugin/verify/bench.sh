#!/bin/bash
# Interleaved getppid cost: none / loaded-nothing-monitored / monitored (records on, live drain)
IMG=${IMG:-$(ls -d /root/.cache/vmsight/images/*/ | head -1)}
P=$IMG/profile.json
CMD='for i in 1 2; do s=$(date +%s%N); getppid_loop 1000000; e=$(date +%s%N); echo per_call_ns=$(( (e-s)/1000000 )); done'
ROUNDS=${ROUNDS:-3}
for r in $(seq $ROUNDS); do
  for cfg in none idle mon off; do
    case $cfg in
      none) out=$(./run.sh none "$CMD" 2>&1);;
      idle) out=$(./run.sh "profile=$P" "$CMD" 2>&1);;
      off)  out=$(./run.sh "records=off" "$CMD" 2>&1);;
      mon)  out=$(./run.sh "profile=$P" "$CMD" --comm getppid_loop 2>&1);;
    esac
    for v in $(echo "$out" | grep -o 'per_call_ns=[0-9]*' | cut -d= -f2); do echo "$cfg $v"; done
    echo "$out" | grep -E "^ all" | sed "s/^/$cfg counters: /"
  done
done
