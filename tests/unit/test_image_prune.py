"""Replaced node images: only the project's own dangling images are pruned after a build."""

from harness.run import image


class _Images:
    def __init__(self, result=None, error=None):
        self.calls, self.result, self.error = [], result, error

    def prune(self, filters):
        self.calls.append(filters)
        if self.error:
            raise self.error
        return self.result


class _Client:
    def __init__(self, images):
        self.images = images


def test_prune_asks_only_for_the_projects_dangling_images_and_reports_them():
    images = _Images({"ImagesDeleted": [{"Deleted": "sha256:a"}, {"Untagged": "x"}, {"Deleted": "sha256:b"}],
                      "SpaceReclaimed": 2_500_000_000})
    lines = []
    image._prune_replaced(_Client(images), lines.append)
    assert images.calls == [{"dangling": True, "label": f"{image.IMAGE_LABEL}=node"}]
    assert lines == ["[image] removed 2 layer(s) of replaced node images, 2500 MB"]


def test_a_failed_prune_is_logged_and_the_build_goes_on():
    images = _Images(error=RuntimeError("a prune operation is already running"))
    lines = []
    image._prune_replaced(_Client(images), lines.append)
    assert lines and "a prune operation is already running" in lines[0]
