# WIIIIIDE lab. The logic lives in Python (wiiide/, harness/); these targets are the outer shell.
#   make demo    set-up, engine + image where Docker can run, the quick sweep, the report table
#   make test    set-up, then the test suite (Docker tests skip without an engine unless required)

PYTHON ?= python3
WORKERS ?= 2
CONFIG ?= experiments/quick.yaml
BACKEND ?= auto
PYTEST_ARGS ?=
STAMP := build/.setup-stamp

.PHONY: setup image docker-engine docker-engine-stop cluster-up cluster-down sweep report test demo clean

setup: $(STAMP)

$(STAMP): requirements.txt
	$(PYTHON) -m pip install -q -r requirements.txt
	@mkdir -p build && touch $(STAMP)

docker-engine:
	bash docker/engine.sh start

docker-engine-stop:
	bash docker/engine.sh stop

image: setup docker-engine
	$(PYTHON) -m harness image

cluster-up: setup
	$(PYTHON) -m harness up --workers $(WORKERS)

cluster-down: setup
	$(PYTHON) -m harness down

sweep: setup
	$(PYTHON) -m harness sweep $(CONFIG) --backend $(BACKEND)

report: setup
	$(PYTHON) -m harness report $(REPORT)

test: setup
	$(PYTHON) -m pytest $(PYTEST_ARGS)

# The main job. An engine is started when none answers and we are root (else the sweep runs on the
# local backend and says so); the image is built when missing.
demo: setup
	-@bash docker/engine.sh start || echo "no Docker engine: the sweep runs on the local backend"
	$(PYTHON) -m harness sweep experiments/quick.yaml --backend $(BACKEND)

clean:
	rm -rf build/wheelhouse build/rootfs .pytest_cache
