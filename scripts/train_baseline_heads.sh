#!/bin/bash
# The baseline heads of issue 24 for the default target: EAGLE-style, PPSD n=2 and n=4, on the
# shipped PDMs' data (first 3,000 lines of data/chat_train.jsonl), draft vocabulary (their
# draft_ids) and epochs (6), one shared feature cache. Rerun to resume (each run saves its state
# every 50 steps; a finished head is skipped). WORK holds the cache (4.3 GB) and the heads.
# Niced; paused (SIGSTOP) while the file /work/QUIET exists, so timing runs see a quiet machine.
set -e
REPO=$(cd "$(dirname "$0")/.." && pwd)
W=${WORK:-$HOME/.cache/spd-work}
mkdir -p $W && cd $W
[ -f chat3k.jsonl ] || head -n 3000 $REPO/data/chat_train.jsonl > chat3k.jsonl
[ -f vocab8k.json ] || python - <<PY
import json
from safetensors import safe_open
ids = [safe_open(f"$REPO/src/spd/assets/pdm/{d}/pdm.safetensors", "pt").get_tensor("draft_ids").tolist()
       for d in ("smollm2-135m-n2-15-15", "smollm2-135m-n4-8-8-7-7")]
assert ids[0] == ids[1], "the shipped PDMs' draft vocabularies differ"
json.dump({"ids": sorted(ids[0]), "vocab_size": 49152, "source": "draft_ids of the shipped PDMs"}, open("vocab8k.json", "w"))
PY
common="--model default --data $W/chat3k.jsonl --draft-vocab $W/vocab8k.json --cache $W/cache-heads
  --cache-anchors 2,8,15,27 --epochs 6 --lr 2e-3 --batch-tokens 2048 --threads 2 --save-every 50 --eval-every 0 --no-progress"
one() {  # name, extra args
  name=$1; shift
  if [ -f $name/train_summary.json ] && grep -q '"interrupted": null' $name/train_summary.json; then echo "$name done"; return; fi
  if [ -d $REPO/src/spd/assets/heads/smollm2-135m-$name ]; then echo "$name shipped (remove the asset to retrain)"; return; fi
  if [ -f $name/train_state.pt ]; then args="--out $W/$name --resume --no-progress --threads 2"; else args="$common $* --out $W/$name"; fi
  echo "== $name $(date +%T): spd train $args" >> train.log
  nice -n 10 python -m spd train $args >> $name.log 2>&1 &
  pid=$!
  while kill -0 $pid 2>/dev/null; do
    if [ -e /work/QUIET ]; then kill -STOP $pid 2>/dev/null; else kill -CONT $pid 2>/dev/null; fi
    sleep 5
  done
  wait $pid; echo "   rc=$? $(date +%T)" >> train.log
}
# ppsd-n4 before ppsd-n2: `spd bench run`'s default methods use n=4
one eagle --method eagle
one ppsd-n4 --method ppsd --stages 4 --split 8,8,7,7
one ppsd-n2 --method ppsd --stages 2
