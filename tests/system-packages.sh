#!/bin/sh
# System packages the tests use, installed by `make test` before the suite (as root, with apt-get):
# Chromium (the widget test), slurm-wlm + munge + openmpi-bin (two Slurm nodes in namespaces),
# sudo + acl (the hub's test user) and configurable-http-proxy from npm (the hub).
# Where this cannot run, each test that needs a missing package skips and names it.
set -u
PACKAGES="chromium slurm-wlm munge openmpi-bin sudo acl"
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    echo "make: not root, or no apt-get: the tests that need $PACKAGES or configurable-http-proxy skip where they are missing"
    exit 0
fi
missing=""
for package in $PACKAGES; do
    dpkg -s "$package" >/dev/null 2>&1 || missing="$missing $package"
done
if ! command -v configurable-http-proxy >/dev/null 2>&1 && ! command -v npm >/dev/null 2>&1; then
    missing="$missing npm"
fi
if [ -n "$missing" ]; then
    echo "make: installing the system packages the tests use:$missing"
    export DEBIAN_FRONTEND=noninteractive
    { apt-get update -qq && apt-get install -y -qq $missing >/dev/null; } \
        || echo "make: apt-get could not install$missing; the tests that need them will skip and say so"
fi
if ! command -v configurable-http-proxy >/dev/null 2>&1 && command -v npm >/dev/null 2>&1; then
    npm install -g --silent configurable-http-proxy@5 >/dev/null \
        || echo "make: npm could not install configurable-http-proxy; the hub test will skip and say so"
fi
exit 0
