# The kvplane image: one static-ish binary for `kvplane serve`, `bridge`, `gateway`.
# (No container runtime on the development machines: this file is not built in CI.)
FROM rust:1.95-bookworm AS build
RUN apt-get update && apt-get install -y --no-install-recommends protobuf-compiler && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
RUN cargo build --release --locked -p kvplane-node && cp target/release/kvplane /kvplane

FROM gcr.io/distroless/cc-debian12:nonroot
COPY --from=build /kvplane /usr/local/bin/kvplane
USER 65532:65532
ENTRYPOINT ["/usr/local/bin/kvplane"]
