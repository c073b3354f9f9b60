"""The store service's protocol: ``store.proto`` and its generated modules (``scripts/gen_proto.sh``)."""

MAX_MESSAGE_BYTES = 256 << 20
