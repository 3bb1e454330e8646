#!/bin/bash
# Alternate before/after bench-wire runs (results/<build>-<i>/), then the node-socket study between two containers.
set -u
# Needs worktrees /work/wt/wire-before (the commit before) and /work/wt/wire-after (the commit after).
STUDY=${STUDY:-$(cd "$(dirname "$0")" && pwd)}  # this folder (pair.py), mounted into the containers
LOG=/work/wt/wire/results/ab.log
echo "after commit $(git -C /work/wt/wire-after rev-parse --short HEAD), before commit $(git -C /work/wt/wire-before rev-parse --short HEAD)" >> $LOG
for i in 1 2; do
  for build in before after; do
    if [ $build = before ]; then dir=/work/wt/wire-before; img=wiiide:wire-before; else dir=/work/wt/wire-after; img=wiiide:wire; fi
    echo "== run $i $build $(date -u +%H:%M:%S) $(uptime)" >> $LOG
    (cd $dir && PYTHONPATH=$dir WIIIIIDE_IMAGE=$img WIIIIIDE_PROJECT=wiiide-wire python -m harness bench-wire --backend docker \
      --sizes 1MiB,16MiB --frame-codecs none --sections frames --repeats 5 --bytes-per-trial-mib 512 \
      --results-dir /work/wt/wire/results/$build-$i) >> $LOG 2>&1
    echo "== end $i $build $(date -u +%H:%M:%S) $(uptime)" >> $LOG
  done
done
echo "== study $(date -u +%H:%M:%S) $(uptime)" >> $LOG
NET=wiiide-wire-study
docker network create --label com.docker.compose.project=wiiide-wire $NET >/dev/null
for size in 1048576 16777216; do
  count=$((536870912 / size))
  docker run -d --name wiiide-wire-study-sink --label com.docker.compose.project=wiiide-wire --network $NET -e SIZE=$size -e COUNT=$count -e REPEATS=5 \
     -v $STUDY:/study:ro wiiide:wire python /study/pair.py sink 29777 >/dev/null
  sleep 4
  echo "-- size $size" >> $LOG
  docker run --rm --name wiiide-wire-study-source --label com.docker.compose.project=wiiide-wire --network $NET -e SIZE=$size -e COUNT=$count -e REPEATS=5 \
     -v $STUDY:/study:ro wiiide:wire python /study/pair.py source wiiide-wire-study-sink 29777 raw,encode,encode-pytimeout,encode-kerneltimeout >> $LOG 2>&1
  docker rm -f wiiide-wire-study-sink >/dev/null 2>&1
done
docker network rm $NET >/dev/null
echo "== end study $(date -u +%H:%M:%S) $(uptime)" >> $LOG
