#!/bin/sh
# The SSH tests' "other machine" (tests/ssh/conftest.py): run as root inside the network namespace
# the fixture made (`ip netns exec NS unshare --mount --propagation private sh host_ns.sh ...`), so
# every mount below exists only in this private mount namespace and goes with its last process.
#
#   host_ns.sh HOME UID GID AUTHORIZED_KEYS PRIVATE_HOME [BIND ...] -- SSHD ARGS...
#
# * HOME: the host user's home, a fresh tmpfs owned by the user (mode 700): from this side the
#   folder stays empty; only SSH/SFTP reach what the host writes there.
# * PRIVATE_HOME (e.g. /root, mode 700, where the test run's python and model live): covered by a
#   tmpfs (mode 755) that holds read-only bind mounts of the BIND paths under it only (the python
#   installation, the model cache): the host can run this checkout's venv without anyone
#   chmod-ing the real folder, and sees nothing else of it.
set -eu
home=$1 uid=$2 gid=$3 authorized=$4 private=$5
shift 5

mount -t tmpfs -o "mode=0700,uid=$uid,gid=$gid,size=4g" kvvhost-home "$home"
for d in .config .local/share .local/state .cache .ssh; do mkdir -p "$home/$d"; done
cp "$authorized" "$home/.ssh/authorized_keys"
chown -R "$uid:$gid" "$home"
chmod 700 "$home/.ssh"
chmod 600 "$home/.ssh/authorized_keys"

stage=$(mktemp -d)
mount --bind "$private" "$stage"
mount -t tmpfs -o mode=0755,size=1m kvvhost-private "$private"
while [ "$#" -gt 0 ] && [ "$1" != "--" ]; do
    rel=${1#"$private"/}
    mkdir -p "$private/$rel"
    mount --bind "$stage/$rel" "$private/$rel"
    mount -o remount,bind,ro "$private/$rel"
    shift
done
shift  # the "--"
umount "$stage"
rmdir "$stage"
echo "kvvhost namespace ready" >&2
exec "$@"
