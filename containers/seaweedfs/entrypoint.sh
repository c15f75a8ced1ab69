#!/bin/sh
# Start SeaweedFS (master, volume, filer and S3 in one `weed mini` process) with the AWS_*
# credentials from the environment enforced on S3, create $BUCKET, then mark the container
# ready for its health check. Nothing of the credentials is written to disk.
set -eu
for name in AWS_ACCESS_KEY_ID AWS_SECRET_ACCESS_KEY; do
  printenv "$name" >/dev/null || { echo "error: set $name (weed enforces it on S3)" >&2; exit 2; }
done
ready=/tmp/unet-s3-ready
rm -f "$ready"
# S3 binds every interface of the container (compose publishes it on the host's 127.0.0.1
# only); the other services advertise the container's loopback to each other. -logtostderr:
# the log is the container's (weed's glog would also write files into its /tmp, which grow in
# the writable layer; workflows/s3server.py).
weed -logtostderr mini -dir=/data -ip=127.0.0.1 -ip.bind=0.0.0.0 -s3.port=9000 -admin.ui=false \
  -webdav=false -master.telemetry=false -master.volumePreallocate=false \
  -volume.preStopSeconds=0 &
server=$!
trap 'kill -TERM "$server"; wait "$server"' TERM INT
# weed shell logs to files whatever -logtostderr says (only its -debug prints to stderr:
# weed/command/shell.go): a folder of their own, removed once the bucket is there.
shell_logs=$(mktemp -d)
tries=0
until echo "s3.bucket.create -name ${BUCKET:-unet-artifacts}" \
    | weed -logdir="$shell_logs" shell -master=127.0.0.1:9333 2>&1 \
    | grep -q -e "created bucket" -e "already exists"; do
  tries=$((tries + 1))
  [ "$tries" -lt 60 ] || { echo "error: bucket ${BUCKET:-unet-artifacts} not created" >&2; exit 2; }
  sleep 1
done
rm -rf "$shell_logs"
python3 -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:9000/healthz', timeout=5)"
touch "$ready"
echo "S3 on :9000, bucket ${BUCKET:-unet-artifacts} ready"
wait "$server"
