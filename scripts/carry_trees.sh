#!/usr/bin/env bash
# Source trees of earlier commits, for a device call to run failing GPU tests against (scripts/gpu_suite.sh part
# bisect_1rank, which tries them in the order given and stops at the first that passes): .carry/trees/<commit>.tgz
# and .carry/trees/ORDER. The device copy has no .git; carry .carry (about 2 MB a tree).
#   scripts/carry_trees.sh REV...   (newest first: the commit before the first suspect, then older ones)
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -gt 0 ] || { echo "usage: scripts/carry_trees.sh REV... (newest first)" >&2; exit 2; }
rm -rf .carry/trees
mkdir -p .carry/trees
for rev in "$@"; do
    commit=$(git rev-parse --short "$rev^{commit}")
    git archive --format=tar.gz -o ".carry/trees/$commit.tgz" "$commit"
    echo "$commit" >> .carry/trees/ORDER
done
du -sh .carry/trees
