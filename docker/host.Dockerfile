# Image of a "host" of `wiiide-lab hosts up` (harness/hosts/): the project's local Debian base plus
# Debian's docker.io (a dockerd of its own, /var/lib/docker on a volume) and docker-registry (the
# distribution registry 2.8, which serves the node image to the hosts). Built by harness.hosts.image
# (legacy builder, context docker/); tagged wiiide-host:<digest of this file, host-init.sh and the base>.
# Packages come from the Debian mirror over plain HTTP, as debootstrap's do (no container registry).
ARG BASE_IMAGE
FROM ${BASE_IMAGE}
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends docker.io docker-registry \
    && rm -rf /var/lib/apt/lists/* \
    && dockerd --version && docker-registry --version \
    && mkdir -p /etc/wiiide \
    && printf 'version: 0.1\nstorage:\n  filesystem:\n    rootdirectory: /var/lib/docker-registry\n  delete:\n    enabled: true\nhttp:\n  addr: :5000\n' > /etc/wiiide/registry.yml
COPY host-init.sh /usr/local/bin/wiiide-host-init
ENTRYPOINT ["/bin/sh", "/usr/local/bin/wiiide-host-init"]
CMD ["dockerd"]
