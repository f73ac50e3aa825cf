# Multi-stage build of every sandboxsched binary.
#   docker build -t sandboxsched .
# compose.yaml builds it for the whole stack.

FROM rust:1-bookworm AS build
WORKDIR /src
COPY . .
# envd and the jail, started for every sandbox, static and not PIE (see the script).
RUN cargo build --release --locked --workspace --bins \
 && scripts/build-static-envd --release \
 && mkdir /out \
 && cp target/release/sandboxsched target/release/ledger-svc target/release/placement-svc \
       target/release/node-svc target/release/e2b-gateway target/release/balance-svc \
       target/x86_64-unknown-linux-gnu/release/sandboxsched-jail \
       target/x86_64-unknown-linux-gnu/release/sandboxsched-envd /out/

FROM debian:bookworm-slim
RUN apt-get update \
 && apt-get install -y --no-install-recommends ca-certificates procps nftables e2fsprogs \
 && rm -rf /var/lib/apt/lists/*
COPY --from=build /out/ /usr/local/bin/
ENV SANDBOXSCHED_LOG_FORMAT=json
