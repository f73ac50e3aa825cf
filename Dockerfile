# Multi-stage build of every sandboxsched binary.
#   docker build -t sandboxsched .
# compose.yaml builds it for the whole stack.

FROM rust:1-bookworm AS build
WORKDIR /src
COPY . .
RUN cargo build --release --locked --workspace --bins \
 && RUSTFLAGS="-C target-feature=+crt-static" cargo build --release --locked -p envd \
       --bin sandboxsched-envd --target x86_64-unknown-linux-gnu \
 && mkdir /out \
 && cp target/release/sandboxsched target/release/ledger-svc target/release/placement-svc \
       target/release/node-svc target/release/e2b-gateway target/release/balance-svc \
       target/release/sandboxsched-jail \
       target/x86_64-unknown-linux-gnu/release/sandboxsched-envd /out/

FROM debian:bookworm-slim
RUN apt-get update \
 && apt-get install -y --no-install-recommends ca-certificates procps nftables \
 && rm -rf /var/lib/apt/lists/*
COPY --from=build /out/ /usr/local/bin/
ENV SANDBOXSCHED_LOG_FORMAT=json
