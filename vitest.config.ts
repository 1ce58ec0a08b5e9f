import swc from 'unplugin-swc';
import { defineConfig } from 'vitest/config';

// SWC compiles the tests and sources: esbuild cannot emit the decorator metadata NestJS and
// class-validator rely on.
export default defineConfig({
  plugins: [swc.vite({ module: { type: 'es6' } })],
  test: {
    include: ['test/**/*.test.ts'],
    exclude: ['test/chaos/**'],
    testTimeout: 60_000,
    hookTimeout: 60_000,
    pool: 'forks',
    maxWorkers: 2,
    reporters: ['default'],
  },
});
