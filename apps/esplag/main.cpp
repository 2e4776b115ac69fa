#include <iostream>
int main() { std::cout << "esplag\n"; }
