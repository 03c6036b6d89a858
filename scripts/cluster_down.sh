#!/usr/bin/env bash
# Tear the test cluster down (idempotent; see netns_cluster.sh).
exec "$(dirname "$0")/netns_cluster.sh" down "$@"
