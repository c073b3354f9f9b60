#!/usr/bin/env bash
# The demo cluster's secrets (docker-compose.yml reads them from deploy/secrets/, which git ignores).
set -euo pipefail
cd "$(dirname "$0")"
mkdir -p secrets
if [ ! -s secrets/store_token ]; then
  (umask 077; python3 -c 'import secrets; print(secrets.token_hex(16))' > secrets/store_token)
fi
echo "deploy/secrets/store_token ready"
