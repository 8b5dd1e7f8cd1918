/* strata.c */
#include "strata.h"
int main(void){return 0;}
