// Control for compute-sanitizer racecheck (bench/results/sanitizer-fwd-sm90-dynamic-*.log): a minimal named-barrier handoff (bar.arrive by a producer warp, bar.sync by a consumer warp), to
// see whether compute-sanitizer racecheck orders a shared-memory write before bar.arrive against a
// read after bar.sync (PTX: bar.arrive has release, bar.sync acquire semantics). fwd_sm90's dynamic
// schedule hands each tile to its consumers this way. Build: nvcc -arch=sm_90 -o handoff bench/sanitizer_handoff.cu
#include <cstdio>
__global__ void handoff(int* out, int rounds) {
    __shared__ int slot;
    const int warp = threadIdx.x / 32;
    for (int r = 0; r < rounds; ++r) {
        if (warp == 0) {
            if (r > 0) asm volatile("bar.sync 2, 64;" ::: "memory");      // consumer has read
            if (threadIdx.x == 0) slot = r * 7;
            asm volatile("bar.arrive 1, 64;" ::: "memory");                // published
        } else {
            asm volatile("bar.sync 1, 64;" ::: "memory");
            const int v = slot;
            if (threadIdx.x == 32) out[r] = v;
            if (r + 1 < rounds) asm volatile("bar.arrive 2, 64;" ::: "memory");
        }
    }
}
int main() {
    int* out; cudaMalloc(&out, 16 * sizeof(int));
    handoff<<<1, 64>>>(out, 16);
    int h[16]; cudaMemcpy(h, out, sizeof(h), cudaMemcpyDeviceToHost);
    int ok = 1; for (int r = 0; r < 16; ++r) ok &= h[r] == r * 7;
    printf("handoff %s\n", ok ? "ok" : "WRONG");
    return 0;
}
