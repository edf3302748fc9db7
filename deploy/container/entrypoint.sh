#!/usr/bin/env bash
# Container entrypoint: runs kvferryd with the config file ($KVFERRY_CONFIG; empty: none)
# and the container's arguments, after refusing a configuration that would listen beyond
# loopback in the open. kvferryd itself refuses plaintext beyond loopback; here a gRPC
# listener beyond loopback also needs clients to authenticate (--auth_tokens or
# --tls_client_ca), and --allow_insecure_remote is refused outright.
# The effective configuration (flags > file > defaults) is kvferryd's own --check-config.
# Exit 78 (EX_CONFIG) when refused; kvferryd's exit status otherwise.
set -euo pipefail
kvferryd=${KVFERRYD:-/usr/local/bin/kvferryd}
config=${KVFERRY_CONFIG-/etc/kvferry/kvferryd.toml}

config_args=()
[ -z "$config" ] || config_args=(--config="$config")
# An empty document is a valid config: it checks the flags alone.
effective=$("$kvferryd" --check-config="${config:-/dev/null}" "$@") || exit $?

# The value of a key in --check-config's "key = value  # source" lines ("" for empty).
value() {
  local v
  v=$(sed -n "s/^$1 = \(.*\)  # [a-z]*\$/\1/p" <<<"$effective")
  [ "$v" = '""' ] && v=""
  printf '%s' "$v"
}
is_loopback() {
  [[ -z $1 || $1 == unix:* || $1 == localhost:* || $1 == "[::1]:"* ||
     $1 =~ ^127\.[0-9]+\.[0-9]+\.[0-9]+: ]]
}
refuse() {
  echo "kvferryd-entrypoint: refusing to start: $*" >&2
  exit 78
}

listen=$(value listen)
metrics_listen=$(value metrics_listen)
tls_cert=$(value tls_cert)
if [ "$(value allow_insecure_remote)" = true ]; then
  refuse "allow_insecure_remote serves plaintext beyond loopback; configure TLS instead"
fi
if ! is_loopback "$listen"; then
  [ -n "$tls_cert" ] ||
    refuse "listen=$listen is beyond loopback without TLS (set tls_cert and tls_key)"
  [ -n "$(value auth_tokens)" ] || [ -n "$(value tls_client_ca)" ] ||
    refuse "listen=$listen is beyond loopback and clients do not authenticate" \
           "(set auth_tokens, or tls_client_ca for client certificates)"
fi
if ! is_loopback "$metrics_listen"; then
  [ -n "$tls_cert" ] ||
    refuse "metrics_listen=$metrics_listen is beyond loopback without TLS (set tls_cert and tls_key)"
fi
exec "$kvferryd" "${config_args[@]}" "$@"
