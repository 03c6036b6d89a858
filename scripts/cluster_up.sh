#!/usr/bin/env bash
# Build the throw-away two-host test cluster (see netns_cluster.sh).
exec "$(dirname "$0")/netns_cluster.sh" up "$@"
