# respool service image: build with the dev toolchain, run with production dependencies only.
# Node 22 LTS: Node 20 reached its end of life on 2026-04-30, and some dependencies declare node >= 22 (they run on
# the 20.19+ that package.json allows, which is what the tests run on here).
FROM node:22-bookworm-slim AS build
WORKDIR /app
COPY package.json package-lock.json ./
RUN npm install --no-audit --no-fund
COPY tsconfig.json tsconfig.build.json nest-cli.json ./
COPY src ./src
COPY migrations ./migrations
RUN npm run build && npm prune --omit=dev

FROM node:22-bookworm-slim
ENV NODE_ENV=production
WORKDIR /app
COPY --from=build /app/package.json ./
COPY --from=build /app/node_modules ./node_modules
COPY --from=build /app/dist ./dist
USER node
EXPOSE 3000
# Ready: Postgres and Redis answer, and Redis may not evict keys (the image has no curl: Node's fetch).
HEALTHCHECK --interval=5s --timeout=3s --start-period=30s --retries=3 \
  CMD ["node", "-e", "fetch('http://127.0.0.1:' + (process.env.PORT || 3000) + '/health/ready').then((r) => process.exit(r.ok ? 0 : 1), () => process.exit(1))"]
# The same V8 flags as `npm run start:prod` (a bounded old generation keeps RSS near the live heap).
CMD ["node", "--max-old-space-size=256", "dist/src/main.js"]
