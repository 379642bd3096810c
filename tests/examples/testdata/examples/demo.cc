// A compiled example that the fixture's documents quote.
int twice(int x) {
  int y = x * 2;
  return y;
}

int main() {
  int a = twice(2);
  return a == 4 ? 0 : 1;
}
