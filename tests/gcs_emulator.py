"""A Google Cloud Storage emulator on this machine for the bucket tests (gcp-storage-emulator,
objects in memory), with what tensorstore's conditional reads need and the emulator lacks: a
download names the object's generation (x-goog-generation) and honours ifGenerationNotMatch
(304) and ifGenerationMatch (412), as Cloud Storage does."""

from __future__ import annotations

import http.server
import logging
import socket
import sys
from http import HTTPStatus
from types import SimpleNamespace

from gcp_storage_emulator import server
from gcp_storage_emulator.exceptions import NotFound
from gcp_storage_emulator.handlers import objects

BUCKET = "hamburger-test"


def _with_generations(download):
  def conditional_download(request, response, storage, *args, **kwargs):
    try:
      obj = storage.get_file_obj(request.params["bucket_name"], request.params["object_id"])
    except NotFound:
      return download(request, response, storage, *args, **kwargs)
    generation = str(obj["generation"])
    response["x-goog-generation"] = generation
    response["x-goog-metageneration"] = str(obj.get("metageneration", "1"))
    if (request.query.get("ifGenerationNotMatch") or [None])[0] == generation:
      response.status = HTTPStatus.NOT_MODIFIED
      return None
    if (request.query.get("ifGenerationMatch") or [generation])[0] != generation:
      response.status = HTTPStatus.PRECONDITION_FAILED
      return None
    return download(request, response, storage, *args, **kwargs)
  conditional_download.wrapped = download
  return conditional_download


class _QuietHTTPServer(http.server.HTTPServer):
  """The emulator's server without a traceback on stderr for each client that hangs up before
  its answer (gcsfs and tensorstore drop connections they no longer need): a failing test's
  output shows the test's own errors."""

  def handle_error(self, request, client_address):
    if not isinstance(sys.exc_info()[1], ConnectionError):
      super().handle_error(request, client_address)


def _install_generations() -> None:
  if hasattr(objects.download, "wrapped"):
    return
  server.server = SimpleNamespace(HTTPServer=_QuietHTTPServer)  # what the emulator starts
  conditional = _with_generations(objects.download)
  for _, handlers in server.HANDLERS:
    for method, handler in list(handlers.items()):
      if handler is objects.download:
        handlers[method] = conditional
  objects.download = conditional  # objects.get's alt=media reads go through it too


def start() -> SimpleNamespace:
  """Starts an emulator with bucket BUCKET on a free port; returns it with `env`, the variables
  that send gcsfs, etils.epath, tensorstore and orbax to it (in this process or a child)."""
  _install_generations()
  logging.getLogger("gcp_storage_emulator").setLevel(logging.CRITICAL)  # each miss is logged
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  emulator = server.create_server("127.0.0.1", port, in_memory=True, default_bucket=BUCKET)
  emulator.start()
  url = f"http://127.0.0.1:{port}"
  # gcsfs would first ask the emulator, over gRPC it does not serve, for the bucket's layout
  # (hierarchical namespace or not), and wait a minute for the answer.
  env = {"STORAGE_EMULATOR_HOST": url, "TENSORSTORE_GCS_HTTP_URL": url,
         "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false"}
  return SimpleNamespace(server=emulator, bucket=BUCKET, url=url, env=env)
