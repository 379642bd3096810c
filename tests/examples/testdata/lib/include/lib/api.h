// An API whose first example is right and whose second drifted.
//
// Call it like this (examples/demo.cc):
//
//   int a = twice(2);
//   return a == 4 ? 0 : 1;
//
// Or like this (examples/demo.cc):
//
//   int b = twice(2);
#pragma once
int twice(int x);
