# WIIIIIDE lab. The logic lives in Python (wiiide/, harness/); these targets are the outer shell.
#   make demo    set-up, engine + image where Docker can run, the quick sweep, the report table and page
#   make test    set-up and the browser, then the test suite (Docker tests skip without an engine unless required)

PYTHON ?= python3
WORKERS ?= 2
SET ?=
CONFIG ?= experiments/quick.yaml
BACKEND ?= auto
PYTEST_ARGS ?=
STAMP := build/.setup-stamp

HOSTS ?= 3

.PHONY: setup browser netem-vm image docker-engine docker-engine-stop cluster-up cluster-down cluster-status hosts-up hosts-down sweep report test demo clean

setup: $(STAMP)

# The project and everything it needs, from pyproject.toml (the one list), with the test extras.
$(STAMP): pyproject.toml
	$(PYTHON) -m pip install -q -e '.[test]'
	@mkdir -p build && touch $(STAMP)

# Headless chromium for the HTML report's browser test, from Debian's packages (never another download).
# Idempotent: nothing to do when it is there; without root the browser test skips and says why.
browser:
	@if [ -x /usr/bin/chromium ]; then :; \
	elif [ "$$(id -u)" = 0 ]; then \
		echo "installing Debian's chromium (for the HTML report's browser test)"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium fonts-dejavu-core >/dev/null \
		&& /usr/bin/chromium --version; \
	else echo "chromium missing and not root: the browser test will skip"; fi

# The netem path's fidelity check in a VM of Debian's kernel (docs/links-impairments.md, "Through netem"):
# installs qemu-system-x86, busybox-static and cpio with apt-get when missing (root), fetches
# linux-image-amd64's package into build/netem-vm/ (nothing installed on the host) and writes
# results/bench-link-vm-<stamp>.json. ARGS: more bench-link options (ARGS="--accel tcg --vm-timeout 1500").
netem-vm: setup
	$(PYTHON) -m harness bench-link --vm $(ARGS)

docker-engine:
	bash docker/engine.sh start

docker-engine-stop:
	bash docker/engine.sh stop

image: setup docker-engine
	$(PYTHON) -m harness image

# SET="key=value ..." takes any RunConfig field or cluster key, as a sweep point (link=rate-100m cpus=0.5).
# BACKEND=swarm: a stack on Docker Swarm (started on this node when the engine is in none).
cluster-up: setup
	$(PYTHON) -m harness up --workers $(WORKERS) $(foreach s,$(SET),--set $(s)) $(if $(filter swarm,$(BACKEND)),--backend swarm)

cluster-down: setup
	$(PYTHON) -m harness down $(if $(filter swarm,$(BACKEND)),--backend swarm)

# The running cluster live (Ctrl-C stops watching, the cluster keeps running); ARGS=--once: one snapshot.
cluster-status: setup
	$(PYTHON) -m harness status $(ARGS)

# Several Docker hosts on this machine (docs/multi-host.md): HOSTS containers with their own dockerd in one
# swarm and a registry serving them the node image; then run on them with
# `wiiide-lab sweep SPEC --backend swarm --hosts`. hosts-down removes all of it.
hosts-up: setup docker-engine
	$(PYTHON) -m harness hosts up --hosts $(HOSTS)

hosts-down: setup
	$(PYTHON) -m harness hosts down

sweep: setup
	$(PYTHON) -m harness sweep $(CONFIG) --backend $(BACKEND)

# The newest report (or REPORT=path, or REPORT="a.json b.json" to compare): table, then the HTML page.
report: setup
	$(PYTHON) -m harness report $(REPORT) --html

test: setup browser
	$(PYTHON) -m pytest $(PYTEST_ARGS)

# The main job. An engine is started when none answers and we are root (else the sweep runs on the
# local backend, which cannot shape links, with the unshaped points only, and says so); the image is
# built when missing. The sweep prints its report's path last; the report verb then prints the table
# (with each engine's samples/s against DDP's), that path and, last, the HTML page's path.
demo: setup
	@if [ "$(BACKEND)" != local ] && bash docker/engine.sh start; then only=; \
	else echo "no Docker engine (or BACKEND=local): the local backend runs the unshaped points only (link=none)"; \
		only="--only link=none"; fi; \
	$(PYTHON) -m harness sweep experiments/quick.yaml --backend $(BACKEND) $$only > build/demo-sweep.out
	$(PYTHON) -m harness report "$$(tail -n 1 build/demo-sweep.out)" --html

clean:
	rm -rf build/wheelhouse build/rootfs .pytest_cache
