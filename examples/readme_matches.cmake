# cmake -DREADME=README.md -DSOURCE=examples/cpp/quickstart.cpp -P readme_matches.cmake
# Fails unless the README's ```cpp block is exactly the example's source.
file(READ "${README}" readme)
file(READ "${SOURCE}" source)
string(FIND "${readme}" "```cpp\n" begin)
if(begin EQUAL -1)
  message(FATAL_ERROR "${README} has no ```cpp block")
endif()
math(EXPR begin "${begin} + 7")
string(SUBSTRING "${readme}" ${begin} -1 rest)
string(FIND "${rest}" "```" end)
string(SUBSTRING "${rest}" 0 ${end} block)
if(NOT block STREQUAL source)
  message(FATAL_ERROR "the C++ quickstart in ${README} differs from ${SOURCE}; copy the file into "
                      "the README's ```cpp block")
endif()
