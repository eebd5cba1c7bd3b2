#!/usr/bin/env bash
# Copies h2load and wrk, with the libraries they link beyond glibc's own, into .whl/native/ so a
# machine without them (no registry, no Debian packages) can run `gpt2serve bench --native`:
# scripts/gpu_check.sh puts .whl/native/bin on PATH when it is there. Wrappers in bin/ point the
# binaries at lib/. libstdc++ and libgcc_s are left to the target, which has them (torch needs
# them), as are libc, libm and libpthread. Run from the project's root after
# scripts/debian_test_deps.sh (or `apt-get install nghttp2-client wrk`).
set -euo pipefail
dest=.whl/native
rm -rf "$dest"
mkdir -p "$dest/bin" "$dest/lib"
for tool in h2load wrk; do
  path=$(command -v "$tool") || { echo "$tool is not installed: apt-get install nghttp2-client wrk" >&2; exit 1; }
  cp "$path" "$dest/$tool.bin"
  for lib in $(ldd "$path" | awk '/=>/ {print $3}'); do
    case $(basename "$lib") in
      libc.so*|libm.so*|libpthread*|libdl*|libstdc++*|libgcc_s*) ;;
      *) cp -L "$lib" "$dest/lib/" ;;
    esac
  done
  printf '#!/bin/sh\nhere=$(dirname "$(readlink -f "$0")")/..\nLD_LIBRARY_PATH=$here/lib exec "$here/%s.bin" "$@"\n' "$tool" >"$dest/bin/$tool"
  chmod +x "$dest/bin/$tool"
done
"$dest/bin/h2load" --version | head -1
du -sh --apparent-size "$dest"
