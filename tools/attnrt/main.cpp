#include <CLI/CLI.hpp>

#include <cstdio>

#include "attnrt/core/error.h"

int main(int argc, char** argv) {
  CLI::App app{"attnrt: the attention layer of an LLM serving engine"};
  app.require_subcommand(0, 1);
  CLI11_PARSE(app, argc, argv);
  return 0;
}
