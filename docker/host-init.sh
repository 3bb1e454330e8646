#!/bin/sh
# Entry point of a "host" container (harness/hosts/): make what its dockerd writes writable, then exec it.
# The container is not --privileged (that asks for every capability, and an engine whose bounding set lacks
# one refuses to start it): it gets the capabilities it can have, unconfined seccomp/AppArmor and
# unmasked system paths; cgroup v1's per-controller bind mounts (this container's own subtree) and /sys
# come read-only and are remounted read-write here, as --privileged would have mounted them.
set -eu
mount -o remount,rw /sys
for d in /sys/fs/cgroup/*/; do
    mount -o remount,bind,rw "$d"
done
exec "$@"
